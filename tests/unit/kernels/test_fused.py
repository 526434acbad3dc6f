"""The fused CPU kernels (kernels/fused_cpu.cpp, built by kernels/fused.py) against the torch ops they replace."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from lorad.kernels import fused
from lorad.server.engine.api import build_model
from lorad.server.engine.training.trainer import torch_threads

needs_compiler = pytest.mark.skipif(fused._compiler() is None, reason="no C++ compiler on this machine")


@pytest.fixture(scope="module")
def ops() -> object:
    """The built kernels; where a compiler exists they must build and load (make setup builds them)."""
    if fused._compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    got = fused.kernels()
    assert got is not None, "the fused kernels did not build although a compiler is installed"
    return got


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _operands(rows: int = 67, cols: int = 96, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gate and up as column blocks of one wider tensor (as the stacked GEMM's widened output is), an odd row count
    (remainder rows per thread), values out to |x| = 12 (the exp's whole useful range)."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(rows, 2 * cols, generator=g) * 4
    gu[0, :4] = torch.tensor([12.0, -12.0, 0.0, -0.0])
    return {
        "x": torch.randn(rows, cols, generator=g) * 3,
        "w": torch.randn(cols, generator=g),
        "gate": gu[:, :cols],
        "up": gu[:, cols:],
        "d": torch.randn(rows, cols, generator=g),
    }


def test_rms_norm_matches_torch_and_recomputes_bit_for_bit(ops: object) -> None:
    t = _operands()
    y, yb, rstd = fused.rms_norm_forward(t["x"], t["w"], 1e-5, want_bf16=True)
    with fused.disabled():
        y_ref, _, rstd_ref = fused.rms_norm_forward(t["x"], t["w"], 1e-5)
        dx_ref = fused.rms_norm_backward(t["d"], t["x"], rstd_ref, t["w"])
    assert _rel(y, y_ref) < 1e-6 and _rel(rstd, rstd_ref) < 1e-6
    assert yb is not None and torch.equal(yb, y.to(torch.bfloat16))  # the GEMM's operand: y rounded, nothing else
    assert torch.equal(fused.rms_norm_apply(t["x"], rstd, t["w"]), y)
    assert _rel(fused.rms_norm_backward(t["d"], t["x"], rstd, t["w"]), dx_ref) < 1e-5
    assert fused.rms_norm_forward(t["x"], t["w"], 1e-5)[1] is None


def test_swiglu_matches_torch_on_column_blocks(ops: object) -> None:
    t = _operands()
    act, act_b = fused.swiglu_forward(t["gate"], t["up"], want_bf16=True)
    d_gu, d_gu_b = fused.swiglu_backward(t["d"], t["gate"], t["up"], want_bf16=True)
    with fused.disabled():
        act_ref, _ = fused.swiglu_forward(t["gate"], t["up"])
        d_gu_ref, _ = fused.swiglu_backward(t["d"], t["gate"], t["up"])
    gate = t["gate"].clone().requires_grad_()
    up = t["up"].clone().requires_grad_()
    (torch.nn.functional.silu(gate) * up * t["d"]).sum().backward()
    assert _rel(act, act_ref) < 1e-6
    f = t["gate"].shape[1]
    assert _rel(d_gu[:, :f], gate.grad) < 1e-6 and _rel(d_gu[:, f:], up.grad) < 1e-6  # type: ignore[arg-type]
    assert _rel(d_gu, d_gu_ref) < 1e-6
    assert act_b is not None and torch.equal(act_b, act.to(torch.bfloat16))
    assert d_gu_b is not None and torch.equal(d_gu_b, d_gu.to(torch.bfloat16))
    assert torch.equal(fused.swiglu_forward(t["gate"], t["up"])[0], act)  # recomputation gives the same bits


def _lora_operands(rows: int = 67, cols: int = 100, rg: int = 3, ru: int = 5, seed: int = 2) -> dict[str, Any]:
    """Gate and up products as column blocks of one bf16 product (as the stacked GEMM returns it), a width that is no
    multiple of the kernel's 32-column tiles, a row count that is no multiple of its 8-row tiles, two ranks, and h as
    a transposed view (as torch's thin product gives it)."""
    g = torch.Generator().manual_seed(seed)
    prod = (torch.randn(rows, 2 * cols, generator=g) * 3).to(torch.bfloat16)
    return {
        "pg": prod[:, :cols],
        "pu": prod[:, cols:],
        "h": (torch.randn(rg + ru, rows, generator=g) * 2).t(),
        "bg": torch.randn(cols, rg, generator=g),
        "bu": torch.randn(cols, ru, generator=g),
        "s": 1.5,
        "d": torch.randn(rows, cols, generator=g),
    }


def test_lora_swiglu_matches_torch_and_gives_the_backward_the_forwards_act(ops: object) -> None:
    t = _lora_operands()
    prods, bs, kw = (t["pg"], t["pu"]), (t["bg"], t["bu"]), {"scaling": t["s"]}
    act, act_b, _ = fused.lora_swiglu_forward(prods, t["h"], bs, **kw, want_bf16=True)
    d_gu, d_gu_b, act_again = fused.lora_swiglu_backward(t["d"], prods, t["h"], bs, **kw, want_bf16=True)
    with fused.disabled():
        act_ref, _, _ = fused.lora_swiglu_forward(prods, t["h"], bs, **kw)
        d_gu_ref, _, _ = fused.lora_swiglu_backward(t["d"], prods, t["h"], bs, **kw)
    gate = (t["pg"].float() + t["s"] * t["h"][:, :3] @ t["bg"].t()).requires_grad_()
    up = (t["pu"].float() + t["s"] * t["h"][:, 3:] @ t["bu"].t()).requires_grad_()
    (torch.nn.functional.silu(gate) * up * t["d"]).sum().backward()
    assert _rel(act, act_ref) < 1e-6 and _rel(d_gu, d_gu_ref) < 1e-6
    assert _rel(act, (torch.nn.functional.silu(gate) * up).detach()) < 1e-6
    assert _rel(d_gu[:, :100], gate.grad) < 1e-6 and _rel(d_gu[:, 100:], up.grad) < 1e-6
    assert torch.equal(act_again, act)  # the backward's act is the forward's, bit for bit
    assert torch.equal(fused.lora_swiglu_forward(prods, t["h"], bs, **kw)[0], act)
    assert act_b is not None and torch.equal(act_b, act.to(torch.bfloat16))
    assert d_gu_b is not None and torch.equal(d_gu_b, d_gu.to(torch.bfloat16))
    assert fused.lora_swiglu_backward(t["d"], prods, t["h"], bs, **kw)[1] is None


def test_lora_swiglu_forward_takes_the_next_layers_rank_rows_in_its_pass(ops: object) -> None:
    t = _lora_operands(cols=96)
    prods, bs = (t["pg"], t["pu"]), (t["bg"], t["bu"])
    a_next = torch.randn(6, 96, generator=torch.Generator().manual_seed(3))
    act, act_b, h_next = fused.lora_swiglu_forward(prods, t["h"], bs, scaling=t["s"], want_bf16=True, a_next=a_next)
    act_alone, _, none = fused.lora_swiglu_forward(prods, t["h"], bs, scaling=t["s"])
    assert none is None and torch.equal(act, act_alone)  # the same act, with or without the rank rows
    assert act_b is not None and torch.equal(act_b, act.to(torch.bfloat16))
    assert h_next is not None and h_next.shape == (67, 6)
    assert _rel(h_next, act.double() @ a_next.double().t()) < 1e-6
    again = fused.lora_swiglu_forward(prods, t["h"], bs, scaling=t["s"], a_next=a_next)[2]
    assert again is not None and torch.equal(again, h_next)
    w = _lora_operands()  # 100 columns: no multiple of 16, the caller's lowrank_rows then
    assert fused.lora_swiglu_forward((w["pg"], w["pu"]), w["h"], (w["bg"], w["bu"]), scaling=1.0,
                                     a_next=torch.randn(6, 100))[2] is None  # fmt: skip
    with fused.disabled():
        assert fused.lora_swiglu_forward(prods, t["h"], bs, scaling=t["s"], a_next=a_next)[2] is None
    with pytest.raises(RuntimeError, match=r"a_next must be a float32 \[r, 96\] matrix"):
        ops.lora_swiglu_fwd(*prods, t["h"], *bs, 1.0, False, a_next[:, :95])  # type: ignore[attr-defined]


def test_lora_swiglu_backward_takes_gate_ups_and_downs_lora_gradients_in_its_pass(ops: object) -> None:
    t = _lora_operands(cols=96)  # a multiple of 16, no multiple of 32 (the tiles' padded width is wider)
    prods, h, bs, s = (t["pg"], t["pu"]), t["h"], (t["bg"], t["bu"]), t["s"]
    g_next = torch.randn(6, 67, generator=torch.Generator().manual_seed(4)).t()  # a transposed view, as MKL gives it
    got = fused.lora_swiglu_backward_grads(t["d"], prods, h, bs, g_next, scaling=s)
    assert got is not None
    d_gu_b, da_next, g, db_g, db_u = got
    d_gu, d_gu_b_ref, act_ref = fused.lora_swiglu_backward(t["d"], prods, h, bs, scaling=s, want_bf16=True)
    assert d_gu_b_ref is not None and torch.equal(d_gu_b, d_gu_b_ref)
    assert da_next.shape == (6, 96) and _rel(da_next, s * g_next.double().t() @ act_ref.double()) < 1e-6
    dg, du = d_gu.double()[:, :96], d_gu.double()[:, 96:]
    hg, hu = h.double()[:, :3], h.double()[:, 3:]
    assert g.shape == (67, 8)
    assert _rel(g, torch.cat([dg @ t["bg"].double(), du @ t["bu"].double()], 1)) < 1e-6
    assert db_g.shape == (96, 3) and db_u.shape == (96, 5) and db_g.is_contiguous() and db_u.is_contiguous()
    assert _rel(db_g, s * dg.t() @ hg) < 1e-6 and _rel(db_u, s * du.t() @ hu) < 1e-6
    again = fused.lora_swiglu_backward_grads(t["d"], prods, h, bs, g_next, scaling=s)
    assert again is not None and all(torch.equal(a, b) for a, b in zip(again, got, strict=True))
    # what the kernel does not take is the caller's to compute the usual way
    w = _lora_operands()  # 100 columns: no multiple of 16
    wb = (w["bg"], w["bu"])
    assert fused.lora_swiglu_backward_grads(w["d"], (w["pg"], w["pu"]), w["h"], wb, g_next, scaling=1.0) is None
    with fused.disabled():
        assert fused.lora_swiglu_backward_grads(t["d"], prods, h, bs, g_next, scaling=s) is None
    with pytest.raises(RuntimeError, match="the intermediate size must be a multiple of 16, got 100"):
        ops.lora_swiglu_bwd_grads(w["d"], w["pg"], w["pu"], w["h"], *wb, g_next, 1.0)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"d_act has shape \[67, 95\], expected \[67, 96\]"):
        ops.lora_swiglu_bwd_grads(t["d"][:, :95], *prods, h, *bs, g_next, 1.0)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"g_d must be a float32 \[67, r\] matrix, got \[66, 6\]"):
        ops.lora_swiglu_bwd_grads(t["d"], *prods, h, *bs, g_next[:66], 1.0)  # type: ignore[attr-defined]


def test_lora_out_grads_match_the_thin_products_and_the_bf16_copy(ops: object) -> None:
    g = torch.Generator().manual_seed(5)
    rows = 133  # two 64-row blocks and a remainder, a remainder tile of 5 rows
    dys = [torch.randn(rows, 160, generator=g)[:, :96], torch.randn(rows, 32, generator=g)]  # strided rows, two widths
    bs = [torch.randn(96, 8, generator=g), torch.randn(4, 32, generator=g).t()]  # ranks 8 and 4, B as a view
    h = torch.randn(12, rows, generator=g).t()
    got = fused.lora_out_grads(dys, h, bs, scaling=0.5, want_bf16=True)
    assert got is not None
    packed, g_rows, d_bs = got
    assert packed is not None and torch.equal(packed, torch.cat([d.to(torch.bfloat16) for d in dys], 1))
    for i, (dy, b, o, r) in enumerate(zip(dys, bs, (0, 8), (8, 4), strict=True)):
        assert _rel(g_rows[:, o : o + r], dy.double() @ b.double()) < 1e-6, i
        assert d_bs[i].shape == b.shape and _rel(d_bs[i], 0.5 * dy.double().t() @ h[:, o : o + r].double()) < 1e-6, i
        assert d_bs[i].is_contiguous(), i  # lora_B's layout: autograd accumulates it without a copy
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused.lora_out_grads(dys, h, bs, scaling=0.5, want_bf16=False)
    finally:
        torch.set_num_threads(before)
    assert one is not None and one[0] is None and torch.equal(one[1], g_rows)
    assert all(torch.equal(a, b) for a, b in zip(one[2], d_bs, strict=True))
    assert (
        fused.lora_out_grads([torch.randn(rows, 100)], h[:, :8], [torch.randn(100, 8)], scaling=1.0, want_bf16=True)
        is None
    )
    with pytest.raises(RuntimeError, match=r"h must be a float32 \[133, 12\] matrix, got \[133, 11\]"):
        ops.lora_out_grads(dys, h[:, :11], bs, 1.0, True)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="one lora_B per output gradient: got 2 gradients and 1 matrices"):
        ops.lora_out_grads(dys, h, bs[:1], 1.0, True)  # type: ignore[attr-defined]


def test_rms_norm_a_grads_match_the_thin_product_over_the_recomputed_rows(ops: object) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(133, 160, generator=g)[:, :96] * 3  # strided rows; two 64-row blocks and a remainder
    w = torch.randn(96, generator=g)
    _, _, rstd = fused.rms_norm_forward(x, w, 1e-5)
    gr = torch.randn(11, 133, generator=g).t()  # [R, k] as a transposed view, an odd rank
    got = fused.rms_norm_a_grads(x, rstd, w, gr, scaling=0.5)
    assert got is not None and got.shape == (11, 96)
    y = fused.rms_norm_apply(x, rstd, w)
    assert _rel(got, 0.5 * gr.double().t() @ y.double()) < 1e-6
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fused.rms_norm_a_grads(x, rstd, w, gr, scaling=0.5), got)
    finally:
        torch.set_num_threads(before)
    assert fused.rms_norm_a_grads(torch.randn(133, 100), rstd, torch.randn(100), gr, scaling=1.0) is None
    with pytest.raises(RuntimeError, match=r"g must be a float32 \[133, k\] matrix, got \[132, 11\]"):
        ops.rms_norm_a_grads(x, rstd, w, gr[:132], 1.0)  # type: ignore[attr-defined]


def test_lowrank_rows_match_the_thin_product(ops: object) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(133, 160, generator=g)[:, :96] * 3  # strided rows; a remainder tile of 5 rows
    for k in (5, 24):  # an odd rank (a short last pass of k), and three members' A stacked
        a = torch.randn(k, 96, generator=g)
        got = fused.lowrank_rows(x, a)
        assert got.shape == (133, k) and got.is_contiguous()
        assert _rel(got, x.double() @ a.double().t()) < 1e-6
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(fused.lowrank_rows(x, a), got)
        finally:
            torch.set_num_threads(before)
    narrow, a = torch.randn(133, 100, generator=g), torch.randn(5, 100, generator=g)  # no multiple of 16: torch's
    torch.testing.assert_close(fused.lowrank_rows(narrow, a), narrow @ a.t())
    with pytest.raises(RuntimeError, match=r"a must be a \[k, 96\] matrix with k > 0, got \[5, 80\]"):
        ops.lowrank_rows(x, torch.randn(5, 80))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="the row width must be a multiple of 16, got 100"):
        ops.lowrank_rows(narrow, a)  # type: ignore[attr-defined]


def test_bf16_rows_give_what_their_widened_copy_gives(ops: object) -> None:
    """o_proj's input is the bf16 attention output: ``lowrank_rows`` and ``lowrank_a_grads`` widen it a tile at a time
    (exact), so h and dA are the bits the widened copy gives, without the copy."""
    g = torch.Generator().manual_seed(8)
    xb = (torch.randn(133, 160, generator=g)[:, :96] * 3).to(torch.bfloat16)  # strided bf16 rows
    a, gr = torch.randn(8, 96, generator=g), torch.randn(8, 133, generator=g).t()  # g as a transposed view
    assert torch.equal(fused.lowrank_rows(xb, a), fused.lowrank_rows(xb.float(), a))
    da = fused.lowrank_a_grads(xb, gr, scaling=0.5)
    assert da.shape == (8, 96) and torch.equal(da, fused.lowrank_a_grads(xb.float(), gr, scaling=0.5))
    assert _rel(da, 0.5 * gr.double().t() @ xb.double()) < 1e-6
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fused.lowrank_a_grads(xb, gr, scaling=0.5), da)  # row blocks added in a fixed order
    finally:
        torch.set_num_threads(before)
    with fused.disabled():  # torch's thin products over the widened rows
        torch.testing.assert_close(fused.lowrank_a_grads(xb, gr, scaling=0.5), da, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused.lowrank_rows(xb, a), fused.lowrank_rows(xb.float(), a))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got Half"):
        ops.lowrank_a_grads(xb.half(), gr, 1.0)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"g must be a float32 \[133, k\] matrix, got \[132, 8\]"):
        ops.lowrank_a_grads(xb, gr[:132], 1.0)  # type: ignore[attr-defined]


# Calls of every kernel that works on 16-float vectors, on seeded operands; run against the native build here and
# against a build for narrower vectors in a child process (the same text, so the same operands).
_VECTOR_CASES = """
def vector_cases(ops, torch):
    g = torch.Generator().manual_seed(11)
    def r(*shape):
        return torch.randn(*shape, generator=g)
    x, a, h, w = r(133, 160)[:, :96], r(24, 96), r(12, 133).t(), r(96)
    rstd = torch.rand(133, 1, generator=g) + 0.5
    dys, bs = [r(133, 96), r(133, 32)], [r(96, 8), r(4, 32).t()]
    prod, hh, m = (r(133, 100) * 3).to(torch.bfloat16), r(5, 133).t(), r(100, 5).t()
    pg, pu, d = (r(133, 96) * 3).to(torch.bfloat16), (r(133, 96) * 3).to(torch.bfloat16), r(133, 96)
    packed, rows, dbs = ops.lora_out_grads(dys, h, bs, 0.5, True)
    q, kv, dout = r(2, 4, 37, 32), r(2, 2, 37, 32), r(2, 37, 4 * 32)
    att, lse = ops.causal_attention_f32_fwd(q, kv, kv * 0.5, 0.25)
    return [
        att, lse, *ops.causal_attention_f32_bwd(dout, q, kv, kv * 0.5, lse, 0.25),
        ops.lowrank_rows(x, a),
        ops.widen_lowrank(prod, hh, m, torch.empty(0), 1.75),
        ops.lowrank_a_grads(x.to(torch.bfloat16), h, 0.25),
        packed.float(), rows, *dbs,
        ops.rms_norm_a_grads(x, rstd, w, h, 0.5),
        *[t.float() for t in ops.lora_swiglu_bwd_grads(d, pg, pu, h, r(96, 8), r(96, 4), r(6, 133).t(), 1.5)],
        *[t.float() for t in ops.lora_swiglu_fwd(pg, pu, h, r(96, 8), r(96, 4), 1.5, True, r(6, 96))],
    ]
"""


@needs_compiler
def test_a_build_for_narrower_vectors_computes_what_the_native_one_does(ops: object, tmp_path: Path) -> None:
    """The kernels' 16-float vectors are the machine's registers in parts: one on AVX-512, two on AVX2, four on SSE or
    NEON (the phone). The generic build (no -march: SSE2 on x86, four parts) must give what this machine's build gives,
    up to rounding (with or without fused multiply-adds)."""
    cxx = fused._compiler()
    assert cxx is not None
    lib, out = tmp_path / "generic.so", tmp_path / "out.pt"
    subprocess.run([cxx, str(fused.SOURCE), "-o", str(lib), *fused._flags(False)], check=True, capture_output=True)
    child = (
        "import sys, torch\n" + _VECTOR_CASES + "\ntorch.ops.load_library(sys.argv[1])\n"
        "torch.save(vector_cases(torch.ops.lorad_fused, torch), sys.argv[2])\n"
    )
    subprocess.run([sys.executable, "-c", child, str(lib), str(out)], check=True, capture_output=True, timeout=120)
    scope: dict[str, Any] = {}
    exec(_VECTOR_CASES, scope)  # the same text the child ran
    native = scope["vector_cases"](ops, torch)
    narrow = torch.load(out)
    assert len(native) == len(narrow) == 21
    for i, (a, b) in enumerate(zip(native, narrow, strict=True)):
        assert a.shape == b.shape and _rel(b, a) < 1e-5, i


def _lowrank_operands(rows: int = 67, cols: int = 100, k: int = 5, seed: int = 4) -> dict[str, Any]:
    """A bf16 product as a column block of a wider one (rows strided), h and m as transposed views (as the LoRA nodes
    pass ``(A·xᵀ)ᵀ`` and ``Bᵀ``), a bias; an odd row count and a column count that is no whole number of tiles."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(rows, cols + 28, generator=g) * 3).to(torch.bfloat16)
    return {
        "prod": wide[:, 28:],
        "h": torch.randn(k, rows, generator=g).t(),
        "m": torch.randn(cols, k, generator=g).t(),
        "bias": torch.randn(cols, generator=g),
        "s": 1.75,
    }


@pytest.mark.parametrize("k", [576, 592, 600])  # K a multiple of 32; one more 16-column block; an 8-column tail
def test_small_rows_are_the_bf16_product_one_rounding_from_exact(ops: object, k: int) -> None:
    """Generation's per-token product: bf16 operands, fp32 sums, one bf16 rounding, the same bits at any thread count,
    and the GEMM's (None) above SMALL_ROWS rows."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(203, k, generator=g) * 0.05).bfloat16()
    rows = (
        torch.randn(1, k, generator=g) * 3,
        torch.randn(2, k + 40, generator=g)[:, :k],  # strided rows
        torch.randn(2, k, generator=g).bfloat16(),
    )
    for x in rows:
        got = fused.small_rows_bf16(x, w)
        assert got is not None and got.dtype == torch.bfloat16 and got.shape == (x.shape[0], 203)
        xb = x.bfloat16().double()
        exact = xb @ w.double().t()
        bound = exact.abs() * 2**-8 + 1e-5 * (xb.abs() @ w.double().abs().t())  # half a bf16 ulp, fp32 sums
        assert ((got.double() - exact).abs() <= bound).all()
        torch.testing.assert_close(got.float(), torch.mm(x.bfloat16(), w.t()).float(), rtol=2**-7, atol=1e-3)
        with torch_threads(1):
            assert torch.equal(fused.small_rows_bf16(x, w), got)
    assert fused.small_rows_bf16(torch.randn(fused.SMALL_ROWS + 1, k), w) is None
    with fused.disabled():
        assert fused.small_rows_bf16(rows[0], w) is None
    with pytest.raises(RuntimeError, match="small_rows_bf16 takes 1 to 8 rows, got 9"):
        ops.small_rows_bf16(torch.randn(9, k), w)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=f"w has 10 columns, x has {k}"):
        ops.small_rows_bf16(rows[0], w[:, :10].contiguous())  # type: ignore[attr-defined]


def test_a_frozen_bf16_layer_runs_a_token_through_the_small_rows_kernel(ops: object) -> None:
    from lorad.kernels.torch_backend import TorchFrozenLinear

    g = torch.Generator().manual_seed(5)
    lin = TorchFrozenLinear(torch.randn(96, 64, generator=g), torch.randn(96, generator=g), precision="bf16",
                            precision_bwd="bf16", name="layer")  # fmt: skip
    x = torch.randn(1, 64, generator=g)
    w = lin._store["bf16"][0]
    assert torch.equal(lin.bf16_product(x), ops.small_rows_bf16(x, w))  # type: ignore[attr-defined]
    assert torch.equal(lin.forward(x), lin.widen(lin.bf16_product(x)))
    many = torch.randn(16, 64, generator=g)  # a training or eval step's rows: oneDNN's GEMM
    assert torch.equal(lin.bf16_product(many), torch.mm(many.bfloat16(), w.t()))


@pytest.mark.parametrize("shape", [(67, 100, 5), (256, 576, 8), (256, 192, 24), (1, 1, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_widen_lowrank_matches_torch(ops: object, shape: tuple[int, int, int], with_bias: bool) -> None:
    t = _lowrank_operands(*shape)
    bias = t["bias"] if with_bias else None
    got = fused.widen_lowrank(t["prod"], t["h"], t["m"], scaling=t["s"], bias=bias)
    with fused.disabled():
        ref = fused.widen_lowrank(t["prod"], t["h"], t["m"], scaling=t["s"], bias=bias)
    exact = t["prod"].double() + (0.0 if bias is None else bias.double()) + t["s"] * (t["h"].double() @ t["m"].double())
    assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == ref.shape
    assert _rel(got, exact) < 1e-6 and _rel(ref, exact) < 1e-6
    again = fused.widen_lowrank(t["prod"], t["h"].contiguous(), t["m"].contiguous(), scaling=t["s"], bias=bias)
    assert torch.equal(again, got)  # the same bits whatever the operands' strides: the nodes rebuild outputs with it


@pytest.mark.parametrize("cols", [1, 17, 96, 576, 1536])
@pytest.mark.parametrize("with_scales", [True, False])
def test_int8_row_quantization_is_torchs_bit_for_bit(ops: object, cols: int, with_scales: bool) -> None:
    from lorad.kernels._quant import quantize_rows

    g = torch.Generator().manual_seed(cols)
    wide = torch.randn(37, 2 * cols + 3, generator=g) * 40
    a = wide[:, 3 : 3 + cols]  # a column block: strided rows
    a[1] = 0.0  # an all-zero row: scale 1e-30 / 127
    a[2, : min(cols, 8)] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 63.5, -63.5])[: min(cols, 8)]  # halfway
    a[3] *= 1e-6
    c = torch.rand(cols, generator=g) * 0.03 if with_scales else None
    q, s = fused.quantize_rows_i8(a, c)
    q0, s0 = quantize_rows(a if c is None else a * c, 8)
    assert q.dtype == torch.int8 and s.shape == (37, 1)
    assert torch.equal(q, q0) and torch.equal(s, s0)


def test_int8_quantization_of_a_row_with_a_nan_or_an_infinity(ops: object) -> None:
    a = torch.ones(3, 32)
    a[0, 5], a[1, 7] = float("nan"), float("inf")
    q, s = fused.quantize_rows_i8(a)
    assert torch.isnan(s[:2]).all() and s[2, 0] == 1.0 / 127
    assert (q[:2] == 0).all() and (q[2] == 127).all()


@pytest.mark.parametrize("with_cols", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_rescale_is_torchs_bit_for_bit(ops: object, with_cols: bool, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(5)
    acc = torch.randint(-(2**22), 2**22, (45, 203), generator=g, dtype=torch.int32)
    s = torch.rand(45, 1, generator=g) * 1e-3
    c = torch.rand(203, generator=g) if with_cols else None
    b = torch.randn(203, generator=g) if with_bias else None
    y = fused.int8_rescale(acc, s, c, b)
    ref = acc.float().mul_(s)
    if c is not None:
        ref.mul_(c)
    if b is not None:
        ref.add_(b)
    assert y is not None and torch.equal(y, ref)


def test_a_torch_w8a8_layer_gives_the_same_bits_with_and_without_the_kernels(ops: object) -> None:
    from lorad.kernels.frozen import make_frozen_linear

    g = torch.Generator().manual_seed(9)
    w, b = torch.randn(48, 80, generator=g) * 0.05, torch.randn(48, generator=g)
    fl = make_frozen_linear(w, b, backend="torch", precision="w8a8", name="probe")
    x, dy = torch.randn(21, 80, generator=g), torch.randn(21, 48, generator=g)
    y, dx = fl.forward(x), fl.input_grad(dy)
    with fused.disabled():
        assert torch.equal(fl.forward(x), y) and torch.equal(fl.input_grad(dy), dx)


def test_bf16_copies_round_like_torch_at_the_edges(ops: object) -> None:
    """Ties to even, overflow to inf, subnormals, signed zero: what torch's .to(torch.bfloat16) gives; NaN stays NaN."""
    edge = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.3895e38, -3.4e38, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45]
    )
    x = edge.repeat(4, 1)
    ones = torch.ones(x.shape[1])
    _, yb, rstd = fused.rms_norm_forward(x[:, :2], ones[:2], 0.0, want_bf16=True)  # finite rows: y = x·rstd
    y = fused.rms_norm_apply(x[:, :2], rstd, ones[:2])
    assert yb is not None and torch.equal(yb, y.to(torch.bfloat16))
    big = torch.full_like(x, 30.0)  # silu(30)·up = 30·up up to float rounding: the product carries the edge values
    act, act_b = fused.swiglu_forward(big, x, want_bf16=True)
    assert act_b is not None
    ref = act.to(torch.bfloat16)
    nan = ref.isnan()
    assert nan.any() and torch.equal(act_b.isnan(), nan)  # NaN stays NaN (torch's vector path sets other payload bits)
    assert torch.equal(act_b[~nan].view(torch.int16), ref[~nan].view(torch.int16))


def test_rope_matches_torch_on_a_column_view(ops: object) -> None:
    """q as the q/k/v node hands it over: a [B, T, H, D] view of the first columns of the joint output; rotated into
    bf16 heads (the bf16 training attention) and fp32 ones (every other path), gradients back from either."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 37, 9 * 16 + 2 * 3 * 16, generator=g)
    x = qkv[..., : 9 * 16].view(2, 37, 9, 16)
    angles = torch.arange(37.0)[:, None] * torch.rand(8, generator=g)[None]
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    dy = torch.randn(2, 9, 37, 16, generator=g)
    for bf16 in (True, False):
        dyd = dy.to(torch.bfloat16) if bf16 else dy
        y, dx = fused.rope_forward(x, cos, sin, bf16=bf16), fused.rope_backward(dyd, cos, sin)
        with fused.disabled():
            y_ref, dx_ref = fused.rope_forward(x, cos, sin, bf16=bf16), fused.rope_backward(dyd, cos, sin)
        assert y.dtype == (torch.bfloat16 if bf16 else torch.float32)
        assert y.shape == (2, 9, 37, 16) and y.is_contiguous()
        assert dx.dtype == torch.float32 and dx.shape == (2, 37, 9, 16) and dx.is_contiguous()
        # the kernel may fuse x1·c − x2·s into one rounding: at most one bf16 ulp apart, a few fp32 ones
        bound = 2**-7 if bf16 else 1e-5
        assert float(((y.float() - y_ref.float()).abs() / y_ref.float().abs().clamp_min(1e-3)).max()) <= bound
        assert _rel(dx, dx_ref) < 1e-6
    k = fused.kernels()
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous float32 \[37, 16\] tables"):
        k.rope_fwd(x, cos[:5], sin, False)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="g must be a contiguous bfloat16 or float32"):
        k.rope_bwd(dy.double(), cos, sin)  # type: ignore[union-attr]


def test_softmax_cross_entropy_over_bf16_logits_matches_torch(ops: object) -> None:
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(37, 1000, generator=g) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (37,), generator=g)
    grad, grad_ref, untouched = logits.clone(), logits.clone(), logits.clone()
    loss = fused.softmax_xent_bf16_(grad, labels, 37.0)
    with fused.disabled():
        loss_ref = fused.softmax_xent_bf16_(grad_ref, labels, 37.0)
    exact = torch.nn.functional.cross_entropy(logits.double(), labels, reduction="sum")
    assert abs(float(loss) - float(exact)) < 1e-5 * float(exact)
    assert abs(float(loss_ref) - float(exact)) < 1e-5 * float(exact)
    # the same bf16 gradient rows up to a rounding boundary: (p - onehot) / denom
    assert float((grad.float() - grad_ref.float()).abs().max()) < 1e-3 / 37
    assert float((grad != grad_ref).float().mean()) < 1e-2
    assert grad.view(-1)[labels + 1000 * torch.arange(37)].lt(0).all()  # the label's entry is (p - 1) / denom < 0
    assert float(fused.softmax_xent_bf16_(untouched, labels, None)) == float(loss)  # no gradient: logits kept
    assert torch.equal(untouched, logits)
    k = fused.kernels()
    with pytest.raises(RuntimeError, match="label 1000 of row 36 is outside the vocabulary"):
        k.softmax_xent_bf16_(logits.clone(), torch.cat([labels[:36], torch.tensor([1000])]), 1.0)  # type: ignore[union-attr]


def test_swiglu_stays_finite_far_out(ops: object) -> None:
    """silu(x) = x·sigmoid(x) for |x| beyond exp's float range: x for large x, (-)0 for very negative x, no NaN."""
    gate = torch.tensor([[-1e30, -200.0, -90.0, -88.5, 88.5, 90.0, 200.0, 1e30]])
    up = torch.ones_like(gate)
    act, _ = fused.swiglu_forward(gate, up)
    torch.testing.assert_close(act, torch.nn.functional.silu(gate), rtol=1e-6, atol=1e-30)
    d_gu, _ = fused.swiglu_backward(torch.ones_like(gate), gate, up)
    assert torch.isfinite(d_gu).all()


def test_results_do_not_depend_on_the_thread_count(ops: object) -> None:
    t = _operands(rows=301, cols=576)
    lo = _lora_operands(rows=301, cols=576, rg=8, ru=8)
    lora_args = ((lo["pg"], lo["pu"]), lo["h"], (lo["bg"], lo["bu"]))
    lr = _lowrank_operands(rows=301, cols=576, k=24)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(
                (
                    *fused.rms_norm_forward(t["x"], t["w"], 1e-6, want_bf16=True),
                    *fused.swiglu_backward(t["d"], t["gate"], t["up"], want_bf16=True),
                    *fused.lora_swiglu_backward(lo["d"], *lora_args, scaling=1.5, want_bf16=True),
                    *(fused.lora_swiglu_backward_grads(lo["d"], *lora_args, lo["h"][:, :5], scaling=1.5) or ()),
                    *fused.lora_swiglu_forward(
                        *lora_args, scaling=1.5, want_bf16=True, a_next=lo["bg"].t()[:5].contiguous()
                    ),
                    fused.widen_lowrank(lr["prod"], lr["h"], lr["m"], scaling=lr["s"], bias=lr["bias"]),
                )
            )
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_kernels_reject_bad_operands_by_name(ops: object) -> None:
    t = _operands()
    k = fused.kernels()
    with pytest.raises(RuntimeError, match="x must be float32"):
        k.rms_norm_fwd(t["x"].double(), t["w"], 1e-5, False)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32 vector of 96"):
        k.rms_norm_fwd(t["x"], t["w"][:5], 1e-5, False)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="up has shape"):
        k.swiglu_fwd(t["gate"], t["up"][:3], False)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="gate must have contiguous columns"):
        k.swiglu_bwd(t["d"], t["gate"].t(), t["up"], False)  # type: ignore[union-attr]
    lo = _lora_operands()
    with pytest.raises(RuntimeError, match="gate and up products must be bfloat16"):
        k.lora_swiglu_fwd(lo["pg"].float(), lo["pu"], lo["h"], lo["bg"], lo["bu"], 1.0, False, torch.empty(0))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"lora_B must be a float32 \[100, r\] matrix"):
        k.lora_swiglu_fwd(lo["pg"], lo["pu"], lo["h"], lo["bg"][:7], lo["bu"], 1.0, False, torch.empty(0))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"h must be a float32 \[67, 8\] matrix"):
        k.lora_swiglu_fwd(lo["pg"], lo["pu"], lo["h"][:, :7], lo["bg"], lo["bu"], 1.0, False, torch.empty(0))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"d_act has shape \[67, 99\], expected \[67, 100\]"):
        k.lora_swiglu_bwd(lo["d"][:, :99], lo["pg"], lo["pu"], lo["h"], lo["bg"], lo["bu"], 1.0, False)  # type: ignore[union-attr]
    lr = _lowrank_operands()
    with pytest.raises(RuntimeError, match="prod must be a bfloat16 matrix"):
        k.widen_lowrank(lr["prod"].float(), lr["h"], lr["m"], torch.empty(0), 1.0)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"h must be a float32 \[67, k\] matrix"):
        k.widen_lowrank(lr["prod"], lr["h"][:9], lr["m"], torch.empty(0), 1.0)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"m must be a float32 \[5, 100\] matrix, got \[5, 99\]"):
        k.widen_lowrank(lr["prod"], lr["h"], lr["m"][:, :99], torch.empty(0), 1.0)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous float32 vector of 100 elements, got \[3\]"):
        k.widen_lowrank(lr["prod"], lr["h"], lr["m"], lr["bias"][:3], 1.0)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="a must be float32, got BFloat16"):
        k.quantize_rows_i8(t["x"].bfloat16(), torch.empty(0))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"c must be a contiguous float32 vector of 96 elements, got \[95\]"):
        k.quantize_rows_i8(t["x"], t["w"][:95])  # type: ignore[union-attr]
    acc = torch.zeros(67, 96, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"s must hold one float32 per row \(67\)"):
        k.int8_rescale(acc, torch.ones(66, 1), torch.empty(0), torch.empty(0))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="acc must be a contiguous int32 matrix"):
        k.int8_rescale(acc.float(), torch.ones(67, 1), torch.empty(0), torch.empty(0))  # type: ignore[union-attr]
    # The Python entry points take any layout: what the kernels cannot take goes to torch ops.
    act, _ = fused.swiglu_forward(t["gate"].t(), t["up"].t())
    torch.testing.assert_close(act, torch.nn.functional.silu(t["gate"].t()) * t["up"].t())
    prods_t = (lo["pg"].t().contiguous().t(), lo["pu"].t().contiguous().t())  # the same values, columns strided
    bs = (lo["bg"], lo["bu"])
    act, _, _ = fused.lora_swiglu_forward(prods_t, lo["h"], bs, scaling=1.0)
    torch.testing.assert_close(act, fused.lora_swiglu_forward((lo["pg"], lo["pu"]), lo["h"], bs, scaling=1.0)[0])


@needs_compiler
def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name != "build.lock")


def test_build_reuses_its_cached_library_and_names_a_failing_compiler(tmp_path: Path, monkeypatch) -> None:
    calls = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a) or real_run(*a, **k))
    with ThreadPoolExecutor(2) as pool:  # two builders at once: the second waits for the first one's library
        first, second = pool.map(lambda _: fused.build(tmp_path), range(2))
    assert first == second and len(calls) == 1
    inode = first.stat().st_ino
    assert fused.build(tmp_path) == first and first.stat().st_ino == inode  # found, not compiled again
    assert len(calls) == 1
    assert _files(tmp_path) == [first.name]  # no temporary file left behind
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(fused.FusedBuildError, match="building the fused kernels failed") as err:
        fused.build(tmp_path / "other")
    assert "false" in str(err.value)
    (marker,) = _files(tmp_path / "other")  # no library, no temporary file: the failure, with its output
    assert marker.endswith(".failed") and "false" in (tmp_path / "other" / marker).read_text()
    calls.clear()
    with pytest.raises(fused.FusedBuildError, match="failed before"):  # the next process does not compile again
        fused.build(tmp_path / "other")
    assert calls == []
    with pytest.raises(fused.FusedBuildError, match="building the fused kernels failed:"):
        fused.build(tmp_path / "other", retry=True)  # make setup's way: try again
    assert len(calls) == 2  # -march=native, then the generic target


def test_a_build_that_succeeds_after_a_failure_is_used(ops: object, tmp_path: Path, monkeypatch) -> None:
    """A compiler that failed once (a header missing) and works after a fix: ``make setup``'s retry builds, and later
    processes load that build instead of the old failure record."""
    good = fused.build()
    cxx = tmp_path / "cxx"  # fails until "fixed" exists, then "compiles" by copying a real library to -o's path
    cxx.write_text(
        f'#!/bin/sh\n[ -e {tmp_path}/fixed ] || exit 1\nwhile [ "$1" != "-o" ]; do shift; done\ncp {good} "$2"\n'
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    cache = tmp_path / "cache"
    with pytest.raises(fused.FusedBuildError, match="building the fused kernels failed:"):
        fused.build(cache)
    (tmp_path / "fixed").touch()
    with pytest.raises(fused.FusedBuildError, match="failed before"):
        fused.build(cache)
    built = fused.build(cache, retry=True)
    assert _files(cache) == [built.name]  # the failure record is gone with the failure
    assert fused.build(cache) == built


def test_build_deletes_what_other_builds_left_unused(ops: object, tmp_path: Path) -> None:
    import os
    import shutil
    import time

    current = fused.build()
    shutil.copy(current, tmp_path / current.name)  # this machine's library, already built
    old = time.time() - (fused.UNUSED_DAYS + 1) * 86400
    names = {"lorad_fused-x86_64-0000000000000000.so": old, "lorad_fused-x86_64-1111111111111111.failed": old,
             "lorad_fused-x86_64-2222222222222222.so": time.time() - 86400, "lorad_fused-x86_64-3.abc.tmp": time.time(),
             "notes.txt": old}  # fmt: skip
    for name, mtime in names.items():
        (tmp_path / name).write_text("x")
        os.utime(tmp_path / name, (mtime, mtime))
    os.utime(tmp_path / current.name, (old, old))  # unused for long too, but it is the build this process wants
    assert fused.build(tmp_path) == tmp_path / current.name
    assert _files(tmp_path) == sorted([current.name, "lorad_fused-x86_64-2222222222222222.so", "notes.txt"])
    assert (tmp_path / current.name).stat().st_mtime > time.time() - 60  # found: its time renewed


def test_a_build_for_one_cpu_is_not_loaded_on_another(tmp_path: Path, monkeypatch) -> None:
    """-march=native code: the cache key holds the CPU's feature flags (a home directory shared by two machines, a VM
    moved to another host)."""
    flags = fused._flags(True)
    here = fused._library_path(tmp_path, "c++", flags)
    monkeypatch.setattr(fused, "cpu_flags", lambda: ({"sse2", "avx2"}, ""))
    assert fused._library_path(tmp_path, "c++", flags) != here


def test_switch_off_runs_the_torch_ops(monkeypatch) -> None:
    monkeypatch.setenv(fused.ENV_SWITCH, "0")
    assert fused._load() == (None, f"off ({fused.ENV_SWITCH}=0)")


def _tiny_model(precision: str = "bf16") -> torch.nn.Module:
    from lorad.server.engine.api import LoraConfig, ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position=64)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    d, f, kv = 32, 48, 16
    w = {"model.embed_tokens.weight": torch.randn(64, d, generator=g) * 0.2}
    w["model.norm.weight"] = 1 + torch.rand(d, generator=g)
    for i in range(2):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
                  "self_attn.o_proj": (d, d), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
                  "mlp.down_proj": (d, f)}  # fmt: skip
        for n, s in shapes.items():
            w[p + n + ".weight"] = torch.randn(*s, generator=g) / s[1] ** 0.5
        w[p + "input_layernorm.weight"] = 1 + torch.rand(d, generator=g)
        w[p + "post_attention_layernorm.weight"] = 1 + torch.rand(d, generator=g)
    model = build_model(cfg, w, backend="torch", precision=precision, lora=LoraConfig(rank=4, alpha=8.0))
    for p in model.parameters():
        if p.requires_grad:
            with torch.no_grad():
                p.normal_(std=0.1, generator=g)  # nonzero B: every LoRA gradient is exercised
    return model


@pytest.mark.parametrize(("precision", "per_element", "overall"), [("fp32", 1e-5, 3e-6), ("bf16", 5e-2, 1e-2)])
def test_a_training_step_agrees_with_the_torch_ops(ops: object, precision: str, per_element: float, overall: float):
    """Every LoRA gradient of a step, fused kernels against torch ops. In fp32 they differ by float rounding only:
    measured over 8 seeds up to 3e-6 per element and 1.8e-6 overall (h = x·Aᵀ from the kernels' sums, too).
    At bf16 both paths round the same GEMM operands, but where an operand's fp32 value differs in its last bit the
    rounded element moves by one bf16 ulp (2^-8 relative): measured over 8 seeds up to 9e-3 per element and 4e-3
    overall, 3e-7 and 1e-7 where no element flips; a wrong kernel is off by O(1)."""
    model = _tiny_model(precision)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    grads = []
    for off in (False, True):
        model.zero_grad()
        with fused.disabled() if off else contextlib.nullcontext():
            model(ids, ids).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == 2 * 7 * 2
    for a, b in zip(*grads, strict=True):
        assert _rel(a, b) < per_element
    diff = sum(float((a - b).norm()) ** 2 for a, b in zip(*grads, strict=True)) ** 0.5
    assert diff < overall * sum(float(b.norm()) ** 2 for b in grads[1]) ** 0.5


def test_build_model_decides_the_path_before_the_first_step(ops: object, monkeypatch) -> None:
    """The kernels are loaded (or built) when a model is built, so no training step pays for it."""
    monkeypatch.setattr(fused, "_state", {})
    _tiny_model()
    assert fused._state["ops"] is ops and "lorad_fused-" in fused._state["detail"]


def test_describe_says_what_runs_without_building_anything(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fused, "_state", {})
    monkeypatch.setenv(fused.ENV_CACHE, str(tmp_path))
    if fused._compiler() is not None:
        assert fused.describe() == (
            False,
            "not built yet: the first model compiles them (once per machine, about 10 s)",
        )
        assert list(tmp_path.iterdir()) == []  # nothing built, nothing loaded
    monkeypatch.setenv(fused.ENV_SWITCH, "0")
    assert fused.describe() == (False, f"off ({fused.ENV_SWITCH}=0); torch ops run instead")
    assert fused.kernels() is None
    assert fused.describe() == (False, f"off ({fused.ENV_SWITCH}=0); torch ops run instead")
    monkeypatch.setattr(fused, "_compiler", lambda: None)
    monkeypatch.setattr(fused, "_state", {})
    monkeypatch.delenv(fused.ENV_SWITCH)
    assert fused.describe()[1].startswith("unavailable: no C++ compiler found")
    assert fused.kernels() is None
    assert fused.describe() == (
        False,
        "unavailable: no C++ compiler found (set CXX, or install g++ or clang++); torch ops run instead",
    )


def test_describe_names_the_loaded_library(ops: object) -> None:
    active, detail = fused.describe()
    assert active and detail.startswith("active (") and "lorad_fused-" in detail
    unit = fused.kernels().attention_bf16_unit()  # type: ignore[union-attr]
    assert unit in ("AMX tiles", "AVX512-BF16", "")
    assert bool(unit) is bool(fused.kernels().attention_bf16_ready(0))  # type: ignore[union-attr]
    assert detail.endswith(f"; attention on {unit}") is bool(unit)
