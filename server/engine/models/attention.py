"""Causal grouped-query attention for training with bf16 matrix products (fp32 softmax), on CPUs with bf16 dot products.

Why not ``F.scaled_dot_product_attention``: at training shapes (one sequence of 256 tokens, 9 heads of 64, 3 KV heads)
torch's CPU flash kernel runs forward + backward in 5.6 ms per layer in fp32 (and 6.1 ms with bf16 inputs), 2 threads,
Zen 5; this one takes 3.6 ms: the four products per direction are plain bf16 GEMMs (oneDNN, fp32 accumulation) over
the whole [T, T] score matrix, which at T <= 512 is small (9 x 256 x 256 x 2 bytes = 1.2 MB saved per layer).
Error vs exact attention: ~4e-3 relative on the output and a few 1e-3 on the input gradients (tests allow 1.5e-2 and
2.5e-2), from the bf16 rounding of operands, scores and probabilities; the softmax and the row sums of its backward
are fp32, the score gradient dS is formed in bf16 for the bf16 products it feeds.

The output stays bf16, in the [B, T, H*D] layout o_proj takes: o_proj saves that tensor, which this node saves too,
instead of a widened fp32 copy (0.6 MB a SmolLM2 layer), and its bf16 GEMM reads it as it is; the transpose copies
half the bytes and the widen-then-narrow pair is gone. The output gradient then comes back rounded to bf16, the
precision dP and dV already used it at.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

_BF16 = torch.bfloat16


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """[B, H, T, D] -> [B, KV, (H/KV)*T, D] in bf16: the query heads that share one KV head, stacked along T."""
    b, h, t, d = x.shape
    return x.to(_BF16).contiguous().view(b, kv_heads, (h // kv_heads) * t, d)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, h, t, d = q.shape
        kv = k.shape[1]
        qg, kb, vb = _grouped(q, kv), k.to(_BF16).contiguous(), v.to(_BF16).contiguous()
        scale = 1.0 / math.sqrt(d)
        # The scale goes on the [gT, D] operand, not the [gT, T] scores (one pass less over the big matrix).
        s = torch.matmul(qg * scale, kb.transpose(-1, -2)).view(b, kv, h // kv, t, t)
        s.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu_(1), float("-inf"))
        # Softmax of the bf16 scores computes in fp32 inside and rounds its output once, the same numbers as
        # widening first, without two [H, T, T] fp32 passes (1.1-1.2 vs 1.4-1.5 ms per layer, 1 thread, Zen 5).
        p = torch.softmax(s, dim=-1).view(b, kv, (h // kv) * t, t)
        # [B, KV, gT, D] -> the [B, T, H*D] rows o_proj multiplies, still bf16 (one copy of half the bytes)
        out = torch.matmul(p, vb).view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)
        ctx.save_for_backward(qg, kb, vb, p, out)  # o_proj keeps the same tensor as its input (lora._LoRAFrozenFn)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qg, kb, vb, p, out = ctx.saved_tensors
        b, kv, gt, d = qg.shape
        t = kb.shape[2]
        h = gt // t * kv
        dout4 = dout.view(b, t, h, d)
        do = _grouped(dout4.transpose(1, 2), kv)
        dv = torch.matmul(p.transpose(-1, -2), do).float()
        dp = torch.matmul(do, vb.transpose(-1, -2))
        # softmax backward: dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O) per query row: a
        # [gT, D] product instead of a [gT, T] one. Masked entries have P = 0 and get 0. dS is formed in bf16 (it
        # feeds bf16 GEMMs next), the row sums in fp32 (of the same bf16 dO as dP's).
        rows = (dout4.float() * out.view(b, t, h, d)).sum(-1).transpose(1, 2).reshape(b, kv, gt, 1)
        ds = dp.sub_(rows.to(_BF16)).mul_(p)
        dq = torch.matmul(ds, kb).float().mul_(ctx.scale).view(b, h, t, d)
        dk = torch.matmul(ds.transpose(-1, -2), qg).float().mul_(ctx.scale)
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
