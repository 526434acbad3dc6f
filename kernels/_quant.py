"""Quantization helpers shared by the backends: per-channel weight quantization and activation fake-quant."""

from __future__ import annotations

import torch
from torch import Tensor

from lorad.kernels.capabilities import PRECISIONS, capability

__all__ = ["ACT_BITS", "BYTES_PER_WEIGHT", "PRECISIONS", "WEIGHT_BITS", "check_precision"]

# Bits of the weight and activation integer grids per quantized precision.
WEIGHT_BITS = {"w8a16": 8, "w8a8": 8, "w4a16": 4}
ACT_BITS = {"w8a16": 16, "w8a8": 8, "w4a16": 16}
# Relative cost of one weight element in bytes, used by the planner's byte cost model.
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "w8a16": 1.0, "w8a8": 1.0, "w4a16": 0.5}


def check_precision(backend: str, precision: str) -> None:
    """Raise ValueError naming backend and precision unless the capability table lets ``backend`` run it."""
    capability(backend).check(precision)


def quantize_weight(weight: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel quantization of ``weight`` [out, in].

    Returns:
        (q, scale): q int8 [out, in] with values in [-(2^(b-1)-1), 2^(b-1)-1], scale float32 [out].
    """
    qmax = 2 ** (bits - 1) - 1
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1).clamp_min(1e-30)
    scale = absmax / qmax
    q = torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale.contiguous()


def quantize_rows(a: Tensor, bits: int = 8) -> tuple[Tensor, Tensor]:
    """Per-row symmetric quantization of a [T, K] float activation (the grid ``fake_quant_act`` rounds to).

    Returns:
        (q, scale): q int8 [T, K], scale float32 [T, 1]; ``q * scale`` is ``fake_quant_act(a, bits)``.
    """
    qmax = 2 ** (bits - 1) - 1
    scale = a.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30).div_(qmax)
    return torch.round(a / scale).clamp_(-qmax, qmax).to(torch.int8), scale


def fake_quant_act(a: Tensor, bits: int) -> Tensor:
    """Per-row symmetric fake-quant of a [T, K] activation: what static scales plus per-call, per-row rescaling
    compute on the NPU (each token row is divided by its own absmax before the fixed-scale graph)."""
    qmax = 2 ** (bits - 1) - 1
    absmax = a.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    scale = absmax / qmax
    out: Tensor = torch.round(a / scale).clamp_(-qmax, qmax) * scale
    return out
