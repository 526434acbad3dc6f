"""RMSNorm with a frozen weight: the forward and backward math, shared by the norm's own autograd node and by the LoRA
nodes that take a normed input (lora_group, server/engine/models/mlp.py), which save the norm's input and ``rstd``
instead of its output and recompute that output, bit for bit, in their backward."""

from __future__ import annotations

import torch
from torch import Tensor

RMSNorm = tuple[Tensor, float]  # (frozen weight, eps): what a node needs to normalise its input itself


def rms_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(rms_apply(x, rstd, weight), rstd)`` over the last dim, with ``rstd = 1/sqrt(mean(x²) + eps)`` (one float
    per row)."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return rms_apply(x, rstd, weight), rstd


def rms_apply(x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """The normed output from the input and its ``rstd``: the same ops on the same operands give the same bits, so a
    backward that kept ``x`` and ``rstd`` recomputes the forward's output exactly with this."""
    return x * rstd * weight


def rms_backward(g: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """dL/dx for the output gradient ``g`` (the weight is frozen: no weight gradient)."""
    gw = g * weight
    xhat = x * rstd
    return rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
