"""CPU ops with hand-written backward where it saves memory: RMSNorm, SwiGLU, chunked linear cross-entropy; RoPE."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

from lorad.kernels.fused import rope_backward, rope_forward, softmax_xent_, softmax_xent_bf16_
from lorad.kernels.rmsnorm import rms_backward, rms_forward
from lorad.kernels.torch_backend import TorchFrozenLinear
from lorad.server.engine.models.config import ModelConfig


class FrozenMatmul(Protocol):
    """The part of lorad.kernels' FrozenLinear these ops use (2-D float32 CPU tensors)."""

    in_features: int
    out_features: int

    def forward(self, x: Tensor) -> Tensor: ...

    def input_grad(self, dy: Tensor) -> Tensor: ...


class _RMSNorm(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w with a frozen w; saves only x and rstd (one float per row).

    Autograd would save ~2x as much (593 vs 1184 kB at [256, 576]) for the same time (~1 ms fwd+bwd, 1 thread).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, rstd, _ = rms_forward(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        x, rstd, weight = ctx.saved_tensors
        return rms_backward(g, x, rstd, weight), None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim with a frozen weight (no weight gradient)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RMSNorm.apply(x, weight, eps)
    return rms_forward(x, weight, eps)[0]


class _Rope(torch.autograd.Function):
    """RoPE of x [B, T, H, D] (fp32, any strides) into the contiguous [B, H, T, D] attention multiplies (fp32, or bf16
    for the bf16 training attention); its gradient comes back as contiguous fp32 [B, T, H, D] rows, the layout the
    q/k/v node takes.

    With halves x1, x2 and ``y = x·cos + rotate_half(x)·sin``: y1 = x1·c − x2·s, y2 = x2·c + x1·s, so
    dx1 = g1·c + g2·s and dx2 = g2·c − g1·s, in fp32, written straight into the layout the next op reads: one pass
    each way with the fused kernels (``kernels.fused``), else one product and two half-width ``addcmul_``. Autograd's
    version runs ~6 ops a direction (the negated half, a concatenation) and the layout changes around it cost a copy
    each way: at SmolLM2's q and k ([1, 214, 9 and 3, 64]), fp32, 2 threads on an AVX2 EPYC, forward and backward of
    both took ~1.2 ms a layer that way.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, bf16: bool) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return rope_forward(x, cos, sin, bf16=bf16)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        return rope_backward(g.contiguous(), cos, sin), None, None, None


def rope_heads(x: Tensor, cos: Tensor, sin: Tensor, *, bf16: bool = False) -> Tensor:
    """x [B, T, H, D] rotated by the cos/sin tables [T, D] (rotate-half RoPE), as contiguous [B, H, T, D] heads: fp32,
    or with ``bf16`` rounded once (the bf16 training attention's q and k); differentiable, see ``_Rope``."""
    out: Tensor = _Rope.apply(x, cos, sin, bf16)
    return out


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up; saves the two inputs only and recomputes silu(gate) in backward.

    Saves 2/3 of autograd's activations (3.1 vs 4.7 MB per layer at [256, 1536]) for ~0.5 ms more per layer.
    """

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        d_up = g * torch.nn.functional.silu(gate)
        d_gate = torch.ops.aten.silu_backward(g * up, gate)  # one fused kernel: dy * s * (1 + x * (1 - s))
        return d_gate, d_up


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SiLU-gated linear unit used by Llama/Qwen MLPs."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return torch.nn.functional.silu(gate) * up


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse RoPE frequencies [head_dim/2], with Llama 3 long-context scaling when configured."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if not rs or rs.get("rope_type", rs.get("type")) != "llama3":
        return inv
    factor = float(rs["factor"])
    low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


# The last chunk's rows are padded up to a multiple of this: oneDNN compiles (and caches) kernels per GEMM shape, and a
# last chunk of any size (the labelled-token count varies per batch) added ~0.8 MB of kernels a step to a SmolLM2 bf16
# run for as long as new sizes kept coming (23 MB over 30 steps); with at most 4 sizes per chunk of 64 it stays flat.
_ROW_MULTIPLE = 16


# A torch bf16 head multiplies up to _BF16_HEAD_ROWS rows per GEMM and keeps their bf16 logits (17 MB for a SmolLM2
# step's ~170 labelled rows at 49,152 words); the fp32 softmax then runs over them in place (fused.softmax_xent_bf16_).
# Each lm_head GEMM streams the whole weight (56 MB in bf16 for SmolLM2) from memory: in chunks of 64 rows a step read
# it six times, in one block twice (the loss's two GEMMs alone: 21.8 -> 14.1 ms, AMX Xeon, 2 threads). Paired
# interleaved SmolLM2 steps: median -13.5 and -16.1 ms (16 pairs each). The softmax works on the bf16 block itself
# (or, on the torch-ops path, on 16 widened rows at a time: 64-row fp32 chunks beside the block raised the peak from
# 861 to 889-892 MB under tcmalloc).
# The logits block is allocated with its rows rounded up to a multiple of 64, so a step allocates one of four sizes:
# allocated at a multiple of 16, the size changed with nearly every step's labelled-token count and tcmalloc's spans of
# the old sizes stayed behind (peak 900 vs 862 MB, 12-step bench runs at fixed bf16). The GEMMs themselves run on the
# rows rounded up to 16 only (_ROW_MULTIPLE, oneDNN's kernels per shape), writing into the block's first rows: at ~170
# labelled rows, 176 instead of 192 (Zen 5, 2 threads: 29.7 -> 27.4 ms forward and 32.4 -> 30.4 ms input gradient).
_BF16_HEAD_ROWS = 256
_BF16_HEAD_ROW_MULTIPLE = 64


def _bf16_head(head: FrozenMatmul) -> TorchFrozenLinear | None:
    """The torch bf16 frozen layer behind ``head`` (a QueuedMatmul or the layer itself), when it has one."""
    f = getattr(head, "frozen", head)
    if isinstance(f, TorchFrozenLinear) and f.precision_fwd == f.precision_bwd == "bf16" and f.bias is None:
        return f
    return None


def _padded(hc: Tensor, block: int, multiple: int = _ROW_MULTIPLE) -> Tensor:
    """``hc`` with zero rows appended up to a multiple of ``multiple`` rows (at most ``block``), contiguous; the padding
    rows are never read."""
    rows = hc.shape[0]
    padded = min(block, -(-rows // multiple) * multiple)
    if padded != rows:
        hc = torch.cat([hc, hc.new_zeros(padded - rows, hc.shape[1])])
    return hc.contiguous()


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss of a frozen vocab projection + softmax cross-entropy, chunked over tokens.

    Only [chunk, V] fp32 logits exist at any time; the gradient w.r.t. the hidden states is computed in the
    forward pass (softmax - onehot, times W) so nothing vocabulary-sized is saved for backward. A torch bf16 head
    multiplies up to ``_BF16_HEAD_ROWS`` rows at once and keeps that block's bf16 logits; the fp32 softmax runs over
    them and writes their gradient rows back into the block (``fused.softmax_xent_bf16_``), the bf16 operand the
    input-gradient GEMM takes anyway: the same numbers, the weight streamed twice per block instead of per chunk.
    """

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd.Function takes positional args)
        ctx: Any, h: Tensor, labels: Tensor, head: FrozenMatmul, chunk: int, denom: float
    ) -> Tensor:
        need_grad = bool(ctx.needs_input_grad[0])
        total = h.new_zeros(())
        dh = torch.zeros_like(h) if need_grad else None
        bf16 = _bf16_head(head)
        block = _BF16_HEAD_ROWS if bf16 is not None else chunk
        for s in range(0, h.shape[0], block):
            hc, lb = h[s : s + block], labels[s : s + block]
            rows = hc.shape[0]
            hp = _padded(hc, block)
            if bf16 is None:
                full = head.forward(hp)  # [padded, V] fp32; the padding rows are never read
                total = total + softmax_xent_(full[:rows], lb, denom if dh is not None else None)
                if dh is not None:
                    dh[s : s + rows] = head.input_grad(full)[:rows]  # a row's gradient reads its own row only
                continue
            # [padded, V] bf16, in a block allocated at a multiple of 64 rows (see _BF16_HEAD_ROW_MULTIPLE)
            alloc = min(block, -(-rows // _BF16_HEAD_ROW_MULTIPLE) * _BF16_HEAD_ROW_MULTIPLE)
            logits = hp.new_empty(alloc, bf16.out_features, dtype=torch.bfloat16)
            prod = bf16.bf16_product(hp, out=logits[: hp.shape[0]])
            # loss, and the gradient rows written back into the block (the input-gradient GEMM's bf16 operand)
            total = total + softmax_xent_bf16_(prod[:rows], lb, denom if dh is not None else None)
            if dh is not None:
                dh[s : s + rows] = bf16.input_grad_bf16(prod)[:rows]
        ctx.save_for_backward(dh if dh is not None else h.new_empty(0))
        return total / denom

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None, None]:
        (dh,) = ctx.saved_tensors
        return dh * g, None, None, None, None


def linear_cross_entropy(
    h: Tensor, labels: Tensor, head: FrozenMatmul, *, chunk: int = 256, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of `head(h)` against labels without materialising all logits.

    Args:
        h: Hidden states [N, D] (final-norm output), float32.
        labels: Target ids [N]; -100 marks tokens without loss (they are skipped, not computed).
        head: Frozen vocab projection (the tied embedding / lm_head).
        chunk: Tokens per logits chunk; peak extra memory is chunk * V * 4 bytes (256 x 49152 -> 50 MB).
        reduction: "mean" over valid tokens (HF's default) or "sum" (for token-weighted accumulation).

    Returns:
        Scalar loss; 0 with a zero gradient when no token has a label.
    """
    keep = labels != -100
    idx = keep.nonzero().squeeze(1)
    n = int(idx.numel())
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}; use 'mean' or 'sum'")
    if n == 0:
        return (h * 0.0).sum()
    denom = float(n) if reduction == "mean" else 1.0
    return _LinearCrossEntropy.apply(h.index_select(0, idx), labels.index_select(0, idx), head, chunk, denom)
