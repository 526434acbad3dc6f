"""Causal attention against exact (float64) attention, output and all input gradients: the bf16 training path within
bf16 error, the fused fp32 kernels (fp32 training and eval) within fp32 rounding."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lorad.kernels import fused
from lorad.server.engine.models.attention import causal_attention_bf16, causal_attention_f32


@pytest.fixture
def bf16_kernels() -> Any:
    """The kernels, where they run bf16 attention (on AMX tiles or with AVX512-BF16 dot products); else the test is
    skipped (the torch path runs there)."""
    ops = fused.kernels()
    if ops is None or not ops.attention_bf16_ready(0):
        pytest.skip("no AMX tiles or AVX512-BF16 here: the torch path is the one that runs")
    return ops


# Head dims of 64 and 128 run the bf16 kernels where this machine has them (the torch path elsewhere), 32 the torch
# path.
@pytest.mark.parametrize(
    ("heads", "kv_heads", "t", "d"),
    [(9, 3, 64, 32), (4, 4, 17, 32), (6, 1, 5, 32), (9, 3, 256, 64), (4, 2, 33, 64), (3, 1, 2, 64), (2, 2, 47, 128)],
)
def test_matches_exact_causal_attention_within_bf16_error(heads: int, kv_heads: int, t: int, d: int) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, t, heads * d, generator=g, dtype=torch.float64)
    # the exact output in the layout the bf16 one comes in: [B, T, H*D] rows, heads side by side
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(2, t, -1)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = causal_attention_bf16(qf, kf, vf)
    grads = torch.autograd.grad(out, (qf, kf, vf), dout.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert all(gr.dtype == torch.float32 for gr in grads)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b).norm() / b.norm())

    # bf16 operands (unit roundoff 2^-9) and fp32 softmax: ~4e-3 measured; an fp32 accumulator would also pass, a
    # wrong mask, head grouping, head layout or softmax backward would not (errors of order 1).
    assert rel(out, ref) < 1.5e-2
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel(got, want) < 2.5e-2


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out = causal_attention_bf16(qs, ks, vs)
    return [out, *torch.autograd.grad(out, (qs, ks, vs), dout)]


def _operands(b: int, h: int, kv: int, t: int, d: int) -> tuple[torch.Tensor, ...]:
    """q and k in bf16 [B, H, T, D] as rope_heads(bf16=True) gives them, v a fp32 [B, KV, T, D] view of v_proj rows."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, h, t, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, kv, t, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, t, kv, d, generator=g).transpose(1, 2)
    return q, k, v, torch.randn(b, t, h * d, generator=g).to(torch.bfloat16)


def test_bf16_kernels_agree_with_the_torch_path_and_take_less_memory(bf16_kernels: Any) -> None:
    """The kernels compute what the torch path computes (both bf16 products over fp32 softmax; the kernels skip
    the masked half and keep no probabilities for the backward), in the dtypes autograd expects."""
    q, k, v, dout = _operands(1, 9, 3, 100, 64)
    kernels = _run(q, k, v, dout)
    with fused.disabled():
        torch_path = _run(q, k, v, dout)
    assert [x.dtype for x in kernels] == [x.dtype for x in torch_path] == [torch.bfloat16] * 3 + [torch.float32]
    for a, b in zip(kernels, torch_path, strict=True):
        assert float((a.double() - b.double()).norm() / b.double().norm()) < 1e-2
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        causal_attention_bf16(*(x.clone().requires_grad_() for x in (q, k, v)))
    assert not any(t.shape[-1] == 100 and t.dim() >= 3 and t.shape[-2] >= 100 for t in saved)  # no [.., T, T]


def _same_bits_at_any_thread_count(run: Any, *operands: torch.Tensor) -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(*operands)
        torch.set_num_threads(max(2, threads))
        many = run(*operands)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)


def test_bf16_kernels_give_the_same_bits_at_any_thread_count(bf16_kernels: Any) -> None:
    _same_bits_at_any_thread_count(_run, *_operands(2, 4, 2, 70, 64))


def test_bf16_kernels_name_operands_they_cannot_take(bf16_kernels: Any) -> None:
    ops = bf16_kernels  # the head dims they take, which causal_attention_forward asks before calling them
    assert ops.attention_bf16_ready(64) and ops.attention_bf16_ready(128) and not ops.attention_bf16_ready(32)
    q, k, _, _ = _operands(1, 4, 2, 8, 64)
    with pytest.raises(RuntimeError, match="not a multiple of key/value heads 3"):
        ops.causal_attention_fwd(q, torch.zeros(1, 3, 8, 64), torch.zeros(1, 3, 8, 64), 0.125)
    with pytest.raises(RuntimeError, match="head dim must be a multiple of 64, got 32"):
        ops.causal_attention_fwd(q[..., :32], k[..., :32], k[..., :32], 0.125)
    out, lse, vr = ops.causal_attention_fwd(q, k, k, 0.125)
    with pytest.raises(RuntimeError, match="dout must be"):
        ops.causal_attention_bwd(out[:, :4], q, k, vr, lse, 0.125)


def test_rejects_heads_that_do_not_group() -> None:
    q, kv = torch.zeros(1, 5, 4, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        causal_attention_bf16(q, kv, kv)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_model_trains_with_it_only_below_fp32(monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    import lorad.server.engine.models.model as model_mod
    from lorad.kernels.capabilities import cpu_bf16
    from lorad.server.engine.models import attention
    from lorad.server.engine.models.build import build_model
    from lorad.server.engine.models.config import LoraConfig
    from tests.unit.training.test_train_recipe import MCFG, _weights

    calls: list[int] = []
    real = model_mod.causal_attention_bf16
    monkeypatch.setattr(model_mod, "causal_attention_bf16", lambda *a: calls.append(1) or real(*a))
    m = build_model(MCFG, _weights(), backend="torch", precision=precision, lora=LoraConfig(rank=2, alpha=4.0))
    ids = torch.randint(0, MCFG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    m(ids, ids).backward()
    with torch.no_grad():
        m(ids, ids)  # eval: exact attention
    want = MCFG.num_layers if precision == "bf16" and cpu_bf16().native else 0
    assert len(calls) == want
    monkeypatch.setattr(attention, "_SQUARE_MAX_ELEMENTS", MCFG.num_heads * 32 * 32 - 1)  # 12 tokens: one 32-row block
    m(ids, ids).backward()  # too long for the squares now: exact attention, every layer
    assert len(calls) == want


def test_bf16_softmax_equals_widening_first() -> None:
    """attention.py relies on it: softmax of bf16 scores computes in fp32 and rounds once (masked entries too)."""
    g = torch.Generator().manual_seed(3)
    s = (torch.randn(2, 3, 64, 64, generator=g) * 4).to(torch.bfloat16)
    s.masked_fill_(torch.ones(64, 64, dtype=torch.bool).triu_(1), float("-inf"))
    assert torch.equal(torch.softmax(s, dim=-1), torch.softmax(s.float(), dim=-1).to(torch.bfloat16))


def test_the_cached_additive_mask_and_the_in_place_mask_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short sequences add a cached causal bias inside the score GEMM; long ones (above the cache bound) mask the
    scores in place. Both are the same numbers."""
    from lorad.server.engine.models import attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 24, 16, generator=g) for n in (6, 2, 2))
    dout = torch.randn(1, 24, 6 * 16, generator=g).to(torch.bfloat16)

    def run() -> list[torch.Tensor]:
        qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
        out = causal_attention_bf16(qs, ks, vs)
        return [out, *torch.autograd.grad(out, (qs, ks, vs), dout)]

    assert attention._causal_bias(24, 3) is not None
    cached = run()
    monkeypatch.setattr(attention, "_BIAS_MAX_ELEMENTS", 3 * 24 * 24 - 1)
    assert attention._causal_bias(24, 3) is None
    for a, b in zip(cached, run(), strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def f32_kernels() -> Any:
    """The kernels, where they are built (every test machine with a compiler); else the test is skipped."""
    ops = fused.kernels()
    if ops is None:
        pytest.skip(f"the fused kernels do not run here: {fused.describe()[1]}")
    return ops


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
    """float64 attention as [B, T, H*D] rows, and its input gradients for ``dout``."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    y = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True)
    out = y.transpose(1, 2).reshape(dout.shape)
    return [out, *torch.autograd.grad(out, (q64, k64, v64), dout.double())]


def _f32_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = causal_attention_f32(qs, ks, vs)
    assert out is not None
    return [out, *torch.autograd.grad(out, (qs, ks, vs), dout)]


# T below, at and past the 16-row blocks; grouped and plain heads; the head dims of Llama/Qwen models and the smallest
# the kernels take; v as the strided view of v_proj's rows the model passes.
@pytest.mark.parametrize(
    ("b", "heads", "kv_heads", "t", "d"),
    [(1, 9, 3, 214, 64), (2, 4, 2, 37, 32), (1, 2, 1, 16, 16), (1, 4, 4, 100, 128), (2, 6, 1, 2, 64), (1, 2, 2, 1, 16)],
)
def test_f32_kernels_match_exact_attention(f32_kernels: Any, b: int, heads: int, kv_heads: int, t: int, d: int) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, t, heads, d, generator=g).transpose(1, 2)
    k = torch.randn(b, kv_heads, t, d, generator=g)
    v = torch.randn(b, t, kv_heads, d, generator=g).transpose(1, 2)
    dout = torch.randn(b, t, heads * d, generator=g)
    got, want = _f32_run(q, k, v, dout), _exact(q, k, v, dout)
    assert got[0].shape == (b, t, heads * d) and [x.shape for x in got[1:]] == [q.shape, k.shape, v.shape]
    assert all(x.dtype == torch.float32 for x in got)
    for a, e in zip(got, want, strict=True):
        # fp32 products and softmax: ~1e-6 measured (0 where T = 1 makes a gradient exactly 0); a wrong mask, head
        # grouping, block edge or lse would be off by order 1
        assert float((a.double() - e).abs().max()) <= 1e-5 * max(1.0, float(e.abs().max()))


def test_f32_kernels_take_q_contiguous_or_strided(f32_kernels: Any) -> None:
    """A contiguous q at a whole number of 16-row blocks is read in place, a strided one copied: the same bits."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 32, 64, generator=g), torch.randn(1, 2, 32, 64, generator=g), torch.randn(1, 2, 32, 64)
    dout = torch.randn(1, 32, 4 * 64, generator=g)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert q.is_contiguous() and not strided.is_contiguous()
    got = _f32_run(q, k, v, dout)
    for a, b in zip(got, _f32_run(strided, k, v, dout), strict=True):
        assert torch.equal(a, b)
    for a, e in zip(got, _exact(q, k, v, dout), strict=True):
        assert float((a.double() - e).abs().max()) <= 1e-5 * max(1.0, float(e.abs().max()))


def test_f32_kernels_give_the_same_bits_at_any_thread_count(f32_kernels: Any) -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 70, 64, generator=g), torch.randn(2, 2, 70, 64, generator=g), torch.randn(2, 2, 70, 64)
    _same_bits_at_any_thread_count(_f32_run, q, k, v, torch.randn(2, 70, 4 * 64, generator=g))


def test_f32_kernels_name_operands_they_cannot_take(f32_kernels: Any) -> None:
    ops = f32_kernels
    assert ops.attention_f32_ready(16) and ops.attention_f32_ready(128) and not ops.attention_f32_ready(24)
    q, k = torch.zeros(1, 4, 8, 64), torch.zeros(1, 2, 8, 64)
    with pytest.raises(RuntimeError, match="not a multiple of key/value heads 3"):
        ops.causal_attention_f32_fwd(q, torch.zeros(1, 3, 8, 64), torch.zeros(1, 3, 8, 64), 0.125)
    with pytest.raises(RuntimeError, match="head dim must be a multiple of 16, got 24"):
        ops.causal_attention_f32_fwd(q[..., :24], k[..., :24], k[..., :24], 0.125)
    with pytest.raises(RuntimeError, match="q, k, v must be float32, got BFloat16"):
        ops.causal_attention_f32_fwd(q.bfloat16(), k, k, 0.125)
    out, lse = ops.causal_attention_f32_fwd(q, k, k, 0.125)
    with pytest.raises(RuntimeError, match=r"dout must be a float32 \[1, 8, 256\] tensor"):
        ops.causal_attention_f32_bwd(out[:, :4], q, k, k, lse, 0.125)
    with pytest.raises(RuntimeError, match=r"lse must be a contiguous float32 \[1, 4, 8\] tensor"):
        ops.causal_attention_f32_bwd(out, q, k, k, lse[:, :2], 0.125)
    # what the kernels do not take, the model's torch path runs: None, not an error
    assert causal_attention_f32(q[..., :24], k[..., :24], k[..., :24]) is None
    assert causal_attention_f32(q.double(), k.double(), k.double()) is None
    with fused.disabled():
        assert causal_attention_f32(q, k, k) is None
    with pytest.raises(ValueError, match="not a multiple"):
        causal_attention_f32(q, torch.zeros(1, 3, 8, 64), torch.zeros(1, 3, 8, 64))


def test_long_training_sequences_go_to_sdpa(f32_kernels: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' backward holds [B, H, T, T] probabilities and score gradients; past the bound, a step that needs
    gradients runs torch's SDPA (memory in T, not T²). Without gradients (eval) the kernels keep running."""
    from lorad.server.engine.models import attention

    q, k = torch.zeros(1, 4, 40, 16), torch.zeros(1, 2, 40, 16)
    monkeypatch.setattr(attention, "_SQUARE_MAX_ELEMENTS", 4 * 64 * 64)  # T = 40 counts as 64 rows (32-row blocks)
    assert attention.squares_fit(1, 4, 40) and attention.squares_fit(1, 4, 64) and not attention.squares_fit(1, 4, 65)
    assert not attention.squares_fit(2, 4, 40) and not attention.squares_fit(1, 5, 40)
    assert causal_attention_f32(q.requires_grad_(), k, k) is not None
    monkeypatch.setattr(attention, "_SQUARE_MAX_ELEMENTS", 4 * 64 * 64 - 1)
    assert causal_attention_f32(q, k, k) is None
    with torch.no_grad():
        assert causal_attention_f32(q, k, k) is not None
    assert causal_attention_f32(q.detach(), k, k) is not None


@pytest.mark.parametrize("kernels", [True, False])
def test_fp32_training_and_eval_run_the_kernels_where_built(monkeypatch: pytest.MonkeyPatch, kernels: bool) -> None:
    """The fp32 model runs its attention through them in training and eval, the same numbers as torch's SDPA path
    within fp32 rounding; where they are off, SDPA runs. (Head dim 16: the smallest the kernels take.)"""
    import dataclasses

    import lorad.server.engine.models.model as model_mod
    from lorad.server.engine.models.build import build_model
    from lorad.server.engine.models.config import LoraConfig
    from tests.unit.training.test_train_recipe import MCFG, _weights

    if kernels and fused.kernels() is None:
        pytest.skip(f"the fused kernels do not run here: {fused.describe()[1]}")
    ran: list[bool] = []
    real = model_mod.causal_attention_f32
    monkeypatch.setattr(model_mod, "causal_attention_f32", lambda *a: ran.append((r := real(*a)) is not None) or r)
    cfg = dataclasses.replace(MCFG, hidden_size=64, head_dim=16)
    m = build_model(cfg, _weights(cfg), backend="torch", precision="fp32", lora=LoraConfig(rank=2, alpha=4.0))
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))

    def loss_and_grads() -> list[torch.Tensor]:
        m.zero_grad()
        loss = m(ids, ids)
        loss.backward()
        return [loss.detach(), *(p.grad.clone() for p in m.parameters() if p.grad is not None)]

    with contextlib.nullcontext() if kernels else fused.disabled():
        got = loss_and_grads()
        with torch.no_grad():
            m(ids, ids)  # eval
    assert ran == [kernels] * (2 * cfg.num_layers)
    with fused.disabled():
        want = loss_and_grads()
    assert len(got) == len(want) > 1
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
