"""RMSNorm with a frozen weight: the forward and backward math, shared by the norm's own autograd node and by the LoRA
nodes that take a normed input (lora_group, server/engine/models/mlp.py), which save the norm's input and ``rstd``
instead of its output and recompute that output, bit for bit, in their backward.

The math runs over the rows of the last dim in ``kernels.fused`` (one pass each way where the fused kernels are
built, torch ops otherwise); these functions keep the caller's shapes.
"""

from __future__ import annotations

from torch import Tensor

from lorad.kernels import fused

RMSNorm = tuple[Tensor, float]  # (frozen weight, eps): what a node needs to normalise its input itself


def rms_forward(
    x: Tensor, weight: Tensor, eps: float, *, want_bf16: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(y, rstd, y as bf16 or None)`` over the last dim: ``rstd = 1/sqrt(mean(x²) + eps)`` (one float per row,
    shaped ``[..., 1]``) and ``y = rms_apply(x, rstd, weight)``. The bf16 copy, written in the same pass where the
    fused kernels run, is what a bf16 GEMM reading the normed rows takes."""
    c = x.shape[-1]
    y, yb, rstd = fused.rms_norm_forward(x.reshape(-1, c), weight, eps, want_bf16=want_bf16)
    return y.view(x.shape), rstd.view(*x.shape[:-1], 1), None if yb is None else yb.view(x.shape)


def rms_apply(x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """The normed output from the input and its ``rstd``: the same ops on the same operands give the same bits, so a
    backward that kept ``x`` and ``rstd`` recomputes the forward's output exactly with this."""
    c = x.shape[-1]
    return fused.rms_norm_apply(x.reshape(-1, c), rstd.reshape(-1, 1), weight).view(x.shape)


def rms_backward(g: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """dL/dx for the output gradient ``g`` (the weight is frozen: no weight gradient)."""
    c = x.shape[-1]
    return fused.rms_norm_backward(g.reshape(-1, c), x.reshape(-1, c), rstd.reshape(-1, 1), weight).view(x.shape)
