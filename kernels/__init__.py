"""lorad compute kernels: frozen linears on NPU/CPU backends, LoRA ops, precision planning.

Overview (docs/design.md §2, docs/qnn_htp.md):

- ``make_frozen_linear(W, b, backend=..., precision=...)`` returns a ``FrozenLinear``: ``forward(x) = x·Wᵀ + b`` and
  ``input_grad(dy) = dy·W`` on one of ``BACKENDS``; no weight gradient is ever computed.
  * ``torch``: fp32 reference; native bf16 (oneDNN, one bf16 copy, fp32 accumulation) on CPUs with bf16
    instructions, the fast path there, and w8a8 as an int8 GEMM (one int8 copy, int32 accumulation) on CPUs with
    int8 dot products; other precisions emulated by fake-quant so the planner runs on any host.
  * ``ort-cpu``: ONNX Runtime CPU EP, the fast path on CPUs without bf16. fp32 and w8a8. One weight copy serves both
    directions (fp32 W or one int8 per-channel W fed as a graph input to a forward and a backward session).
  * ``qnn-htp``: onnxruntime-qnn plugin EP; static token buckets (pad, strip), FP16 graphs with the weight as a
    graph input (one host copy; weight-free graphs shared by all layers of a shape) or QDQ graphs for
    w8a16/w8a8/w4a16 (per-channel int weights, per-call per-row activation rescale); EP-context cache on disk;
    CPU fallback always disabled; every graph audited against the EP's silent-wrong cases (``audit_graph``).
- ``LoRALinear(frozen, rank, alpha)``: ``y = frozen(x) + s·(drop(x)·Aᵀ)·Bᵀ``; frozen calls go through the single
  ``NpuQueue`` worker while the caller thread computes the LoRA terms (and dA, dB in backward). CPU backends use
  an inline queue (same cores, nothing to overlap; a thread hand-off costs 11-22 us or more under load).
- ``plan_precision`` measures, per layer and precision, how far dA/dB/dX move from the fp32 run and picks the
  cheapest plan within an error budget (``PrecisionPlan``, JSON-serializable, ``.table()``, ``.summary()``).
  ``mode="fast"`` (default): one captured reference fwd+bwd, local per-layer drifts, whole-plan verification
  with back-off; ``mode="exact"``: one full fwd+bwd per (layer, candidate, direction).
- ``load_or_plan(cache_dir, model, loss_fn, weights, model_hash=, backend=, ...)`` returns ``(plan, from_cache)``:
  the plan cached for (model hash, backend, candidates, budget, planner version, layers, extra key) or a new one;
  ``apply_plan(model, plan, weights, backend=)`` re-lowers a built model in place to a plan.
- ``fused``: the elementwise chains around the GEMMs (RMSNorm, SwiGLU and RoPE both ways, the bf16 copies GEMMs read,
  the loss's softmax over bf16 logits, gate/up's LoRA terms inside the SwiGLU) as one-pass C++ kernels compiled once
  per machine (``fused_cpu.cpp``), torch ops where they cannot be built.
- ``capabilities``: the one table of what each backend runs (validation, planner menu, status read it);
  ``costs.measure`` times each weight shape and precision once per machine for the planner's cost model.
- ``detect_backend()`` probes once per process; ``memory_report()`` states the weight bytes held.

Importing this package imports none of its modules (they import torch): each name below is imported on first use
(PEP 562 ``__getattr__``), so ``lorad serve`` starts without torch and a config or capability lookup stays cheap.
The ``TYPE_CHECKING`` block and ``_LAZY`` name the same objects (a test checks).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorad.kernels._quant import PRECISIONS
    from lorad.kernels.detect import BackendInfo, detect_backend
    from lorad.kernels.frozen import BACKENDS, FrozenLinear, make_frozen_linear, memory_report
    from lorad.kernels.lora import FrozenMatmul, LoRALinear
    from lorad.kernels.plan_cache import apply_plan, load_or_plan
    from lorad.kernels.planner import Measurement, PrecisionPlan, plan_precision
    from lorad.kernels.queue import NpuQueue

_K = "lorad.kernels."
# package name -> (module, name there); imported on first use.
_LAZY: dict[str, tuple[str, str]] = {
    "PRECISIONS": (_K + "_quant", "PRECISIONS"),
    **{n: (_K + "detect", n) for n in ("BackendInfo", "detect_backend")},
    **{n: (_K + "frozen", n) for n in ("BACKENDS", "FrozenLinear", "make_frozen_linear", "memory_report")},
    **{n: (_K + "lora", n) for n in ("FrozenMatmul", "LoRALinear")},
    **{n: (_K + "plan_cache", n) for n in ("apply_plan", "load_or_plan")},
    **{n: (_K + "planner", n) for n in ("Measurement", "PrecisionPlan", "plan_precision")},
    "NpuQueue": (_K + "queue", "NpuQueue"),
}  # fmt: skip


def __getattr__(name: str) -> object:
    # No lock of its own: the engine imports under lorad.server.engine.api's, and a second lock taken inside it here
    # could invert with Python's per-module import locks; a name costs what importing its module directly costs.
    where = _LAZY.get(name)
    if where is None:  # also how `from lorad.kernels import fused` finds the submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where[0]), where[1])


__all__ = [
    "BACKENDS",
    "PRECISIONS",
    "BackendInfo",
    "FrozenLinear",
    "FrozenMatmul",
    "LoRALinear",
    "Measurement",
    "NpuQueue",
    "PrecisionPlan",
    "apply_plan",
    "detect_backend",
    "load_or_plan",
    "make_frozen_linear",
    "memory_report",
    "plan_precision",
]
