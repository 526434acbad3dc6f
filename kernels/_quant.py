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


# Elements of a weight quantized at once: each float temporary of quantize_weight is at most 16 MB, whatever the
# weight's size (a whole-tensor pass made three fp32 copies of Qwen2-0.5B's 545 MB embedding while loading).
_QUANT_CHUNK_ELEMENTS = 1 << 22


def quantize_weight(weight: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel quantization of ``weight`` [out, in], a block of rows at a time.

    Returns:
        (q, scale): q int8 [out, in] with values in [-(2^(b-1)-1), 2^(b-1)-1], scale float32 [out].
    """
    qmax = 2 ** (bits - 1) - 1
    w = weight.detach()
    out, cols = int(w.shape[0]), int(w.shape[1])
    q = torch.empty(out, cols, dtype=torch.int8)
    scale = torch.empty(out, dtype=torch.float32)
    step = max(1, _QUANT_CHUNK_ELEMENTS // max(cols, 1))
    for i in range(0, out, step):
        rows = w[i : i + step].to(torch.float32, copy=True)  # divided in place below, never the caller's tensor
        s = torch.div(rows.abs().amax(dim=1).clamp_min(1e-30), qmax, out=scale[i : i + step])
        q[i : i + step] = rows.div_(s[:, None]).round_().clamp_(-qmax, qmax)
    return q, scale


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
