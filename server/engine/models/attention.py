"""Causal grouped-query attention for training with bf16 matrix products (fp32 softmax), on CPUs with bf16 dot products.

Why not ``F.scaled_dot_product_attention``: at training shapes (one sequence of 256 tokens, 9 heads of 64, 3 KV heads)
torch's CPU flash kernel runs forward + backward in 5.6 ms per layer in fp32 (and 6.1 ms with bf16 inputs), 2 threads,
Zen 5; this one takes 3.6 ms: the four products per direction are plain bf16 GEMMs (oneDNN, fp32 accumulation) over
the whole [T, T] score matrix, which at T <= 512 is small (9 x 256 x 256 x 2 bytes = 1.2 MB saved per layer).
Error vs exact attention: ~4e-3 relative on the output and a few 1e-3 on the input gradients (tests allow 1.5e-2 and
2.5e-2), from the bf16 rounding of operands, scores and probabilities; the softmax and the row sums of its backward
are fp32, the score gradient dS is rounded to bf16 once for the bf16 products it feeds.

The output stays bf16, in the [B, T, H*D] layout o_proj takes: o_proj saves that tensor instead of a widened fp32 copy
(0.6 MB a SmolLM2 layer), and its bf16 GEMM reads it as it is; the transpose copies half the bytes and the
widen-then-narrow pair is gone. The output gradient then comes back rounded to bf16, the precision dP and dV already
used it at. Where the causal mask fits a small cache (``_causal_bias``), the scores come from one ``baddbmm`` that adds
it and applies the scale, and the softmax backward is torch's fused kernel: forward + backward of a SmolLM2 layer at 256
tokens 3.41-3.57 -> 2.98-3.26 ms (three interleaved pairs, 2 threads, AMX Xeon), ~10 ms a step.

On a CPU with AMX tiles or AVX512-BF16 and head dims that are a multiple of 64, the fused kernels (``kernels.fused``)
run the same math instead (on the tiles, or in vdpbf16ps register tiles), over the causal half only: each 16 query
rows take their scores against the keys up to their last row, an fp32 softmax and bf16 probabilities, and the
backward recomputes them from each row's log-sum-exp instead of keeping the [H, T, T] probabilities (1.2 MB a SmolLM2
layer). Timed per call inside SmolLM2 training steps (10 interleaved pairs, 2 threads, AMX Xeon): forward 719 -> 611
µs, backward 911 -> 818 µs; -6.9 ms a step over 24 interleaved pairs. With AVX512-BF16 on a Zen 5 (2 threads, 214
tokens, one layer in isolation): forward 1.06 -> 0.49 ms, backward 1.37 -> 1.22 ms. Errors against exact attention
are about half the torch path's (fp32 products into the softmax, no bf16 scores).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from lorad.kernels.fused import (
    attention_f32_takes,
    causal_attention_backward,
    causal_attention_f32_backward,
    causal_attention_f32_forward,
    causal_attention_forward,
)

_BF16 = torch.bfloat16


# Training attention other than torch's SDPA holds per-head [T, T] squares: the bf16 path saves its probabilities for
# the backward, every layer (2 bytes each), the AMX kernels hold probabilities and score gradients while one backward
# runs (4 bytes), the fp32 kernels too (8 bytes). SmolLM2 at 256 tokens: 9 x 256² = 0.6M elements; 14 heads at 1,024
# tokens: 14.7M; seq_len goes to 4,096. Above this many elements a training step runs torch's SDPA in fp32 instead,
# whose memory grows with T, not T² (eval keeps the kernels: their forward holds 16 rows a task).
_SQUARE_MAX_ELEMENTS = 1 << 23


def squares_fit(batch: int, heads: int, t: int) -> bool:
    """Whether a training attention over ``batch`` x ``heads`` sequences of ``t`` tokens may hold its [T, T] squares
    (T rounded up to 32, the AMX kernels' blocks; the fp32 kernels' 16-row blocks need no more)."""
    rows = -(-t // 32) * 32
    return batch * heads * rows * rows <= _SQUARE_MAX_ELEMENTS


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """[B, H, T, D] -> [B, KV, (H/KV)*T, D] in bf16: the query heads that share one KV head, stacked along T."""
    b, h, t, d = x.shape
    return x.to(_BF16).contiguous().view(b, kv_heads, (h // kv_heads) * t, d)


def _as_input(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """A bf16 product's gradient in its input's dtype: kept bf16 for bf16 q/k (as ``rope_heads`` gives them; then
    scaled by 1/sqrt(D) in bf16, exact when D is a power of 4 such as 64, one more bf16 rounding otherwise), widened
    for fp32 ones (autograd would round an fp32 gradient of a bf16 input to bf16 anyway)."""
    return grad if dtype == _BF16 else grad.float()


# The additive causal mask is cached (per sequence length and query heads per KV head) up to this many elements: 3 x
# 256 x 256 (393 kB) for SmolLM2 at 256 tokens; longer sequences mask in place instead of holding g·T² bf16.
_BIAS_MAX_ELEMENTS = 1 << 22


def _causal_bias(t: int, groups: int) -> Tensor | None:
    """The [groups·t, t] bf16 additive mask (0 on and below the diagonal, -inf above) of ``groups`` query heads
    stacked along T, or None when it would exceed ``_BIAS_MAX_ELEMENTS``."""
    return _bias_table(t, groups) if groups * t * t <= _BIAS_MAX_ELEMENTS else None


@functools.lru_cache(maxsize=4)
def _bias_table(t: int, groups: int) -> Tensor:
    mask = torch.zeros(t, t, dtype=_BF16).masked_fill_(torch.ones(t, t, dtype=torch.bool).triu_(1), float("-inf"))
    return mask.repeat(groups, 1)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, h, t, d = q.shape
        kv = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        ctx.scale, ctx.q_dtype, ctx.k_dtype = scale, q.dtype, k.dtype
        tiles = causal_attention_forward(q, k, v, scale)
        ctx.tiles = tiles is not None
        if tiles is not None:  # the fused kernels: the backward recomputes P from the row log-sum-exps
            out, lse, vr = tiles
            ctx.save_for_backward(q, k, vr, lse)
            return out
        qg, kb, vb = _grouped(q, kv), k.to(_BF16).contiguous(), v.to(_BF16).contiguous()
        bias = _causal_bias(t, h // kv)
        if bias is not None:  # scores = bias + scale·Q·Kᵀ in one GEMM: no scaling pass, no masking pass
            s = torch.baddbmm(bias, qg.view(b * kv, -1, d), kb.view(b * kv, t, d).transpose(-1, -2), alpha=scale)
        else:
            # The scale goes on the [gT, D] operand, not the [gT, T] scores (one pass less over the big matrix).
            s = torch.matmul(qg * scale, kb.transpose(-1, -2)).view(b, kv, h // kv, t, t)
            s.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu_(1), float("-inf"))
        # Softmax of the bf16 scores computes in fp32 inside and rounds its output once, the same numbers as
        # widening first, without two [H, T, T] fp32 passes (1.1-1.2 vs 1.4-1.5 ms per layer, 1 thread, Zen 5).
        p = torch.softmax(s, dim=-1).view(b, kv, (h // kv) * t, t)
        # [B, KV, gT, D] -> the [B, T, H*D] rows o_proj multiplies, still bf16 (one copy of half the bytes)
        out = torch.matmul(p, vb).view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)
        ctx.save_for_backward(qg, kb, vb, p)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if ctx.tiles:
            q, k, vr, lse = ctx.saved_tensors
            dq, dk, dv = causal_attention_backward(dout, q, k, vr, lse, scale=ctx.scale)
            return dq.to(ctx.q_dtype), dk.to(ctx.k_dtype), dv
        qg, kb, vb, p = ctx.saved_tensors
        b, kv, gt, d = qg.shape
        t = kb.shape[2]
        h = gt // t * kv
        do = _grouped(dout.view(b, t, h, d).transpose(1, 2), kv)
        dv = torch.matmul(p.transpose(-1, -2), do).float()
        dp = torch.matmul(do, vb.transpose(-1, -2))
        # softmax backward dS = P * (dP - rowsum(dP * P)) as torch's fused kernel: one pass, fp32 row sums inside,
        # dS rounded to bf16 once (it feeds bf16 GEMMs next); masked entries have P = 0 and get 0. 0.07 ms a SmolLM2
        # layer against 0.26 for rowsum(dO * O) in fp32 and two bf16 passes over [gT, T] (AMX Xeon, 2 threads).
        ds = torch._softmax_backward_data(dp, p, -1, _BF16)
        dq = _as_input(torch.matmul(ds, kb), ctx.q_dtype).mul_(ctx.scale).view(b, h, t, d)
        dk = _as_input(torch.matmul(ds.transpose(-1, -2), qg), ctx.k_dtype).mul_(ctx.scale)
        return dq, dk, dv


def causal_attention_bf16(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of q [B, H, T, D] over k, v [B, KV, T, D] (H a multiple of KV), returned as the bf16 rows
    [B, T, H*D] its last GEMM produced, heads side by side: what o_proj multiplies.

    Differentiable w.r.t. q, k and v (its output gradient arrives in bf16, as autograd rounds it to the output's
    dtype); the products run in bf16 with fp32 accumulation, softmax in fp32.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    out: Tensor = _CausalAttention.apply(q, k, v)
    return out


class _CausalAttentionF32(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx.scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = causal_attention_f32_forward(q, k, v, ctx.scale)
        ctx.save_for_backward(q, k, v, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, lse = ctx.saved_tensors
        return causal_attention_f32_backward(dout, q, k, v, lse, scale=ctx.scale)


def causal_attention_f32(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """Causal attention of float32 q [B, H, T, D] over k, v [B, KV, T, D] (H a multiple of KV) by the fused kernels,
    returned as the fp32 rows [B, T, H*D] o_proj multiplies; differentiable w.r.t. q, k and v. None where the kernels
    do not take these operands, or a step that needs gradients would hold more [T, T] squares than ``squares_fit``
    allows (the caller runs ``F.scaled_dot_product_attention`` then).

    Why not ``F.scaled_dot_product_attention``: its CPU flash kernel took 9.1 ms for a SmolLM2 layer's forward +
    backward at 214 tokens (2 threads, AVX2 EPYC); these kernels take 4.2 (forward 2.29 -> 1.34 ms). They compute
    the causal half only, 16 query rows a task in register tiles of fp32 FMAs, recompute the probabilities in the
    backward from each row's log-sum-exp, and write o_proj's rows directly (no transposing copy). The numbers agree
    within fp32 rounding (~1e-6 relative against float64 attention).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    if not attention_f32_takes(q, k, v):
        return None
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
    if torch.is_grad_enabled() and needs_grad and not squares_fit(q.shape[0], q.shape[1], q.shape[2]):
        return None
    out: Tensor = _CausalAttentionF32.apply(q, k, v)
    return out
