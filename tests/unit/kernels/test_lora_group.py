"""Grouped LoRA nodes (q/k/v as one node; gate/up/down with SwiGLU as one node) against separate LoRALinear layers."""

from __future__ import annotations

import pytest
import torch

from lorad.kernels import LoRALinear, make_frozen_linear
from lorad.kernels.lora_group import backward as lora_group_backward
from lorad.kernels.lora_group import (
    finish_forward,
    forward_keeping_products,
    groupable,
    rebuild,
    shared_input_lora,
    submit_forward,
)
from lorad.server.engine.models.layers import swiglu
from lorad.server.engine.models.mlp import fusable, lora_swiglu


def _layers(shapes: list[tuple[int, int]], *, precision: str = "fp32", seed: int = 0) -> list[LoRALinear]:
    torch.manual_seed(seed)  # LoRALinear draws A from the global generator: the same layers in every run
    g = torch.Generator().manual_seed(seed)
    out = []
    for o, i in shapes:
        m = LoRALinear(make_frozen_linear(torch.randn(o, i, generator=g) / i**0.5, None, backend="torch",
                                          precision=precision), rank=4, alpha=8.0)  # fmt: skip
        with torch.no_grad():
            m.lora_B.normal_(generator=g)  # nonzero B so dA and the LoRA part of dX are exercised
        out.append(m)
    return out


def _grads(layers: list[LoRALinear], x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for m in layers for p in (m.lora_A, m.lora_B)]  # type: ignore[list-item]


def _zero(layers: list[LoRALinear], x: torch.Tensor) -> None:
    x.grad = None
    for m in layers:
        m.lora_A.grad = m.lora_B.grad = None


def test_shared_input_matches_separate_layers() -> None:
    layers = _layers([(12, 16), (4, 16), (4, 16)])
    assert groupable(layers)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    dys = [torch.randn(2, 5, m.out_features, generator=g) for m in layers]
    ys = shared_input_lora(layers, x)
    sum((y * d).sum() for y, d in zip(ys, dys, strict=True)).backward()
    got = [y.detach() for y in ys], _grads(layers, x)
    _zero(layers, x)
    ys_ref = [m(x) for m in layers]
    sum((y * d).sum() for y, d in zip(ys_ref, dys, strict=True)).backward()
    for y, y_ref in zip(got[0], ys_ref, strict=True):
        assert y.shape == y_ref.shape
        torch.testing.assert_close(y, y_ref.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1], _grads(layers, x), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_swiglu_mlp_matches_separate_layers_in_fp32() -> None:
    gate, up, down = _layers([(24, 16), (24, 16), (16, 24)])
    assert fusable(gate, up, down)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 7, 16, generator=g, requires_grad=True)
    dy = torch.randn(1, 7, 16, generator=g)
    layers = [gate, up, down]
    y = lora_swiglu(gate, up, down, x)
    (y * dy).sum().backward()
    got = y.detach(), _grads(layers, x)
    _zero(layers, x)
    y_ref = down(swiglu(gate(x), up(x)))
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(got[0], y_ref.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1], _grads(layers, x), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_members_keep_their_bf16_products_and_rebuild_their_outputs_bit_for_bit() -> None:
    bf16_a, bf16_b = _layers([(24, 16), (24, 16)], precision="bf16")
    (fp32,) = _layers([(24, 16)], seed=1)
    members = [bf16_a, fp32, bf16_b]  # mixed: only the torch bf16 GEMMs have a narrower product to keep
    x2 = torch.randn(7, 16, generator=torch.Generator().manual_seed(3))
    ys, h, kept = forward_keeping_products(members, x2)
    assert [k.dtype for k in kept] == [torch.bfloat16, torch.float32, torch.bfloat16]
    assert kept[1] is ys[1]
    ys_ref, h_ref = finish_forward(members, x2, submit_forward(members, x2))
    assert torch.equal(h, h_ref)
    for y, y_ref, y_again in zip(ys, ys_ref, rebuild(members, h, kept), strict=True):
        assert torch.equal(y, y_ref)
        assert torch.equal(y_again, y)


def test_fused_swiglu_mlp_saves_bf16_gate_and_up_at_bf16_with_the_same_gradients() -> None:
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        layers = _layers([(24, 16), (24, 16), (16, 24)], precision=precision)
        g = torch.Generator().manual_seed(2)
        x = torch.randn(1, 7, 16, generator=g, requires_grad=True)
        dy = torch.randn(1, 7, 16, generator=g)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = lora_swiglu(*layers, x)
        (y * dy).sum().backward()
        # gate and up are kept as their bf16 products at bf16 (half the bytes), as the fp32 outputs otherwise
        assert [t.dtype for t in saved if t.shape == (7, 24)] == [dtype, dtype], precision
        got = _grads(layers, x)
        _zero(layers, x)
        gate, up, down = layers
        (down(swiglu(gate(x), up(x))) * dy).sum().backward()
        for a, b in zip(got, _grads(layers, x), strict=True):  # the rebuilt outputs are the forward's own
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_nodes_that_norm_their_input_keep_it_instead_of_the_normed_rows_and_match_bit_for_bit() -> None:
    """With ``norm`` the q/k/v and MLP nodes apply the RMSNorm themselves and save its input and rstd (which its
    backward needs anyway), not the normed [T, in] rows; the outputs and all gradients equal rms_norm followed by the
    node, bit for bit, at fp32 and bf16."""
    from lorad.server.engine.models.layers import rms_norm

    for precision in ("fp32", "bf16"):
        gen = torch.Generator().manual_seed(4)
        qkv = _layers([(12, 16), (4, 16), (4, 16)], precision=precision)
        mlp = _layers([(24, 16), (24, 16), (16, 24)], precision=precision, seed=1)
        weight = torch.rand(16, generator=gen) + 0.5
        x = torch.randn(1, 7, 16, generator=gen, requires_grad=True)
        dys = [torch.randn(1, 7, n, generator=gen) for n in (12, 4, 4, 16)]

        def run(fused: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
            saved: list[torch.Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                if fused:
                    ys = [*shared_input_lora(qkv, x, (weight, 1e-6)), lora_swiglu(*mlp, x, (weight, 1e-6))]
                else:
                    normed = [rms_norm(x, weight, 1e-6) for _ in range(2)]
                    ys = [*shared_input_lora(qkv, normed[0]), lora_swiglu(*mlp, normed[1])]
            sum((y * d).sum() for y, d in zip(ys, dys, strict=True)).backward()
            grads = [x.grad] + [p.grad for m in qkv + mlp for p in (m.lora_A, m.lora_B)]
            _zero(qkv + mlp, x)
            rows = sum(t.numel() for t in saved if t.dtype == torch.float32 and t.numel() == 7 * 16)
            return [y.detach() for y in ys], grads, rows

        ys, grads, rows = run(True)
        ys_ref, grads_ref, rows_ref = run(False)
        for a, b in zip(ys + grads, ys_ref + grads_ref, strict=True):
            assert torch.equal(a, b), precision
        # separately: each norm saves x, each node its normed rows (4 tensors); fused: each node saves x (2)
        assert (rows, rows_ref) == (2 * 7 * 16, 4 * 7 * 16), precision


def test_not_groupable_with_dropout_hooks_or_rank_zero() -> None:
    a, b = _layers([(8, 16), (8, 16)])
    assert groupable([a, b])
    b.dropout = 0.1
    assert not groupable([a, b])  # each layer draws its own mask
    b.eval()
    assert groupable([a, b])  # dropout is off outside training
    h = a.register_forward_pre_hook(lambda *_: None)
    assert not groupable([a, b])  # a hooked layer must run as a module call
    h.remove()
    zero = LoRALinear(make_frozen_linear(torch.randn(8, 16), None, backend="torch"), rank=0, alpha=1.0)
    assert not groupable([a, zero])


def test_stacked_bf16_members_run_one_gemm_a_direction_from_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v-shaped members at bf16, stacked (torch_backend.stack_bf16): their weights become row blocks of one
    tensor (no byte more), the node multiplies that once a direction, and it agrees with the per-layer products
    within bf16 rounding; the forward outputs rebuild bit for bit; a member the planner rebuilt ends the stacking."""
    from lorad.kernels import torch_backend as tb

    members = _layers([(12, 16), (4, 16), (4, 16)], precision="bf16")
    frozen = [m.frozen for m in members]
    before = [f._store["bf16"][0].clone() for f in frozen]
    nbytes = sum(f.nbytes for f in frozen)
    assert tb.joint_bf16(frozen) is None
    gen = torch.Generator().manual_seed(7)
    x2 = torch.randn(9, 16, generator=gen)
    dys = [torch.randn(9, m.out_features, generator=gen) for m in members]
    h_sep = finish_forward(members, x2, submit_forward(members, x2))[1]
    ys_sep = finish_forward(members, x2, submit_forward(members, x2))[0]
    dx_sep = lora_group_backward(members, x2, h_sep, dys, need_x=True)

    assert tb.stack_bf16(frozen)
    joint = tb.joint_bf16(frozen)
    assert joint is not None and joint.shape == (20, 16)
    assert sum(f.nbytes for f in frozen) == nbytes
    for f, w in zip(frozen, before, strict=True):
        assert torch.equal(f._store["bf16"][0], w)
        assert f._store["bf16"][0].untyped_storage().data_ptr() == joint.untyped_storage().data_ptr()

    calls: list[tuple[int, ...]] = []
    real_mm = torch.mm

    def mm(a: torch.Tensor, b: torch.Tensor, **kw: torch.Tensor) -> torch.Tensor:
        if a.dtype == torch.bfloat16:
            calls.append(tuple(b.shape))
        return real_mm(a, b, **kw)

    monkeypatch.setattr(torch, "mm", mm)
    ys, h, kept = forward_keeping_products(members, x2)
    dx = lora_group_backward(members, x2, h, dys, need_x=True)
    monkeypatch.undo()
    assert calls == [(16, 20), (20, 16)]  # one GEMM forward, one for the summed input gradient
    assert len(kept) == 1 and kept[0].dtype == torch.bfloat16 and kept[0].shape == (9, 20)
    assert torch.equal(h, h_sep)
    for y, y_sep, y_again in zip(ys, ys_sep, rebuild(members, h, kept), strict=True):
        torch.testing.assert_close(y, y_sep, rtol=1e-2, atol=1e-2)
        assert torch.equal(y_again, y)
    assert dx[0] is not None and dx_sep[0] is not None
    torch.testing.assert_close(dx[0], dx_sep[0], rtol=2e-2, atol=2e-2)
    for a, b in zip(dx[1] + dx[2], dx_sep[1] + dx_sep[2], strict=True):  # dA, dB: fp32 LoRA math, unchanged
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    members[1].frozen = make_frozen_linear(before[1].float(), None, backend="torch", precision="bf16")
    assert tb.joint_bf16([m.frozen for m in members]) is None  # the planner's swap: per layer again, same numbers
    ys_back = finish_forward(members, x2, submit_forward(members, x2))[0]
    for y, y_sep in zip(ys_back, ys_sep, strict=True):
        assert torch.equal(y, y_sep)


def test_stacking_stacked_layers_again_copies_nothing() -> None:
    """After a plan is applied the builder's stacking runs again: groups it stacked before keep their tensor."""
    from lorad.kernels import torch_backend as tb

    frozen = [m.frozen for m in _layers([(12, 16), (4, 16)], precision="bf16")]
    assert tb.stack_bf16(frozen)
    joint = tb.joint_bf16(frozen)
    assert joint is not None
    assert tb.stack_bf16(frozen)
    again = tb.joint_bf16(frozen)
    assert again is not None and again.data_ptr() == joint.data_ptr()
    assert not tb.stack_bf16([m.frozen for m in _layers([(12, 16), (4, 16)])])  # fp32: left alone


def test_separate_weights_that_happen_to_lie_back_to_back_are_not_taken_for_stacked() -> None:
    """Two allocations can be adjacent in memory (tcmalloc hands out neighbouring spans): only row blocks of one
    storage are a joint weight; stacking such layers copies them into one."""
    from lorad.kernels import torch_backend as tb

    frozen = [m.frozen for m in _layers([(12, 16), (4, 16)], precision="bf16")]
    raw = bytearray(16 * 16 * 2)
    ws = [f._store["bf16"][0].clone() for f in frozen]
    start = 0
    for f, w in zip(frozen, ws, strict=True):  # each weight in its own storage object over adjacent bytes
        n = w.numel() * 2
        t = torch.frombuffer(memoryview(raw)[start : start + n], dtype=torch.bfloat16).view(w.shape)
        t.copy_(w)
        f._store["bf16"] = (t, None)
        start += n
    assert frozen[0]._store["bf16"][0].data_ptr() + 12 * 16 * 2 == frozen[1]._store["bf16"][0].data_ptr()
    assert tb.joint_bf16(frozen) is None
    assert tb.stack_bf16(frozen)
    joint = tb.joint_bf16(frozen)
    assert joint is not None and torch.equal(joint, torch.cat(ws))


def test_a_single_layer_at_bf16_both_ways_is_a_group_of_one() -> None:
    """down_proj alone: its own bf16 weight serves as the joint one, so its input gradient comes from the stacked
    path (one GEMM, widened with the LoRA part in the same pass); a layer at bf16 one way only is no group."""
    from lorad.kernels import torch_backend as tb

    (m,) = _layers([(24, 16)], precision="bf16")
    assert tb.joint_bf16([m.frozen]) is m.frozen._store["bf16"][0]
    w = m.frozen._dense("bf16")
    fwd_only = tb.TorchFrozenLinear(w, None, precision="bf16", precision_bwd="fp32", name="fwd_only")
    assert tb.joint_bf16([fwd_only]) is None
    g = torch.Generator().manual_seed(5)
    x2, dy = torch.randn(7, 16, generator=g), torch.randn(7, 24, generator=g)
    ys, h = finish_forward([m], x2, submit_forward([m], x2))
    dx, (d_a,), (d_b,) = lora_group_backward([m], x2, h, [dy], need_x=True)
    x = x2.clone().requires_grad_()
    y_ref = m(x)
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(ys[0], y_ref.detach(), rtol=1e-5, atol=1e-5)
    assert dx is not None
    torch.testing.assert_close(dx, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_a, m.lora_A.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_b, m.lora_B.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True])
def test_layers_at_w8a8_take_their_lora_gradients_from_one_pass_over_dy(
    grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer (or group) whose input gradient is another backend's or precision's call (here torch w8a8) takes g and
    dB from one pass over its output gradient (``fused.lora_out_grads``) while that call runs, instead of two thin
    products; the gradients are those of the thin products (torch ops) up to float rounding."""
    from lorad.kernels import fused, lora, lora_group

    if fused.kernels() is None:
        pytest.skip(f"fused kernels not built here: {fused.describe()[1]}")
    layers = _layers([(32, 16), (16, 16)], precision="w8a8")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    dys = [torch.randn(2, 9, m.out_features, generator=g) for m in layers]
    calls = {"n": 0}
    real = fused.lora_out_grads

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(lora, "lora_out_grads", counted)
    monkeypatch.setattr(lora_group, "lora_out_grads", counted)

    def run() -> list[torch.Tensor]:
        _zero(layers, x)
        ys = shared_input_lora(layers, x) if grouped else [m(x) for m in layers]
        sum((y * d).sum() for y, d in zip(ys, dys, strict=True)).backward()
        return _grads(layers, x)

    got = run()
    assert calls["n"] == (1 if grouped else len(layers))
    with fused.disabled():
        ref = run()
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
