"""The FrozenLinear interface, the backend factory and the weight-memory report."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import Tensor

from lorad.kernels.capabilities import BACKENDS

__all__ = ["BACKENDS", "FrozenLinear", "make_frozen_linear", "memory_report"]


@runtime_checkable
class FrozenLinear(Protocol):
    """A frozen weight W [out, in] (+ bias) that computes ``x·Wᵀ + b`` and ``dy·W``, never a weight gradient.

    ``x`` and ``dy`` are 2-D float32 CPU tensors with any number of rows T; backends with static shapes pad to
    token buckets internally and strip the padding.
    """

    in_features: int
    out_features: int
    name: str
    precision_fwd: str
    precision_bwd: str

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) memory this object holds, all directions and buckets included."""
        ...

    def forward(self, x: Tensor) -> Tensor:
        """Return ``x·Wᵀ + b`` as float32 [T, out]."""
        ...

    def input_grad(self, dy: Tensor) -> Tensor:
        """Return ``dy·W`` as float32 [T, in]."""
        ...


def make_frozen_linear(
    weight: Tensor,
    bias: Tensor | None,
    *,
    backend: str,
    precision: str = "fp32",
    precision_bwd: str | None = None,
    name: str = "",
    cache_dir: Path | None = None,
    model_hash: str = "",
    buckets: Sequence[int] = (64, 128, 256, 512),
) -> FrozenLinear:
    """Build a frozen linear on ``backend``.

    Args:
        weight: W [out, in] (any float dtype; copied/converted, the caller may free it).
        bias: optional [out].
        backend: one of BACKENDS.
        precision: forward precision (one of PRECISIONS).
        precision_bwd: input-gradient precision; defaults to ``precision``.
        name: layer name (logs, cache keys).
        cache_dir: where QNN EP-context binaries are cached (qnn-htp only).
        model_hash: part of the cache key so a different base model never loads stale binaries.
        buckets: static token buckets (qnn-htp; CPU backends take any T).

    Raises:
        ValueError: unknown backend, or a precision the backend does not support (the message names both).
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)} for {name!r}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match out_features {weight.shape[0]} ({name!r})")
    pbwd = precision if precision_bwd is None else precision_bwd
    if backend == "torch":
        from lorad.kernels.torch_backend import TorchFrozenLinear

        return TorchFrozenLinear(weight, bias, precision=precision, precision_bwd=pbwd, name=name)
    if backend == "ort-cpu":
        from lorad.kernels.ort_cpu import OrtCpuFrozenLinear

        return OrtCpuFrozenLinear(weight, bias, precision=precision, precision_bwd=pbwd, name=name)
    if backend == "qnn-htp":
        from lorad.kernels.qnn_htp import QnnFrozenLinear

        return QnnFrozenLinear(
            weight,
            bias,
            precision=precision,
            precision_bwd=pbwd,
            name=name,
            cache_dir=cache_dir,
            model_hash=model_hash,
            buckets=tuple(buckets),
        )
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def memory_report(linears: Iterable[FrozenLinear]) -> dict[str, object]:
    """Bytes of weight memory held per frozen linear and in total.

    Returns:
        ``{"per_weight": {name: {"bytes", "shape", "precision_fwd", "precision_bwd"}}, "total_bytes": int,
        "total_mib": float}``; unnamed layers are keyed ``#<index>``.
    """
    per: dict[str, dict[str, object]] = {}
    total = 0
    for i, lin in enumerate(linears):
        key = lin.name or f"#{i}"
        if key in per:
            key = f"{key}#{i}"
        nb = int(lin.nbytes)
        total += nb
        per[key] = {
            "bytes": nb,
            "shape": [lin.out_features, lin.in_features],
            "precision_fwd": lin.precision_fwd,
            "precision_bwd": lin.precision_bwd,
        }
    return {"per_weight": per, "total_bytes": total, "total_mib": round(total / 2**20, 3)}
