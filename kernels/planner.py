"""Precision planner by gradient sensitivity: lower one frozen linear at a time, measure how dA/dB/dX move."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog
import torch
from lorad.kernels._quant import BYTES_PER_WEIGHT
from lorad.kernels.frozen import make_frozen_linear
from lorad.kernels.lora import LoRALinear
from torch import Tensor, nn

log = structlog.get_logger(__name__)

PLAN_VERSION = 1
# Weight storage format per precision: two precisions with one format share one stored copy.
_FORMAT = {"fp32": "fp32", "fp16": "fp16", "w8a16": "int8", "w8a8": "int8", "w4a16": "int4"}


@dataclass(frozen=True)
class Measurement:
    """Gradient drift when one layer's one direction runs at ``precision`` (all else at the reference)."""

    direction: str  # "fwd" | "bwd"
    precision: str
    cos_da: float
    cos_db: float
    cos_dx: float
    rel_da: float
    rel_db: float
    rel_dx: float
    time_ms: float = float("nan")  # measured frozen-product time on the calibration shape (cost="time")

    @property
    def error(self) -> float:
        """The scalar the budget is spent on: the worst relative-norm error of dA, dB and dX."""
        return max(self.rel_da, self.rel_db, 0.0 if math.isnan(self.rel_dx) else self.rel_dx)


@dataclass
class LayerPlan:
    """Chosen precisions of one layer plus every measurement behind the choice."""

    name: str
    shape: tuple[int, int]  # (out, in)
    precision_fwd: str
    precision_bwd: str
    measurements: list[Measurement] = field(default_factory=list)

    def measured(self, direction: str, precision: str) -> Measurement | None:
        """The measurement for ``direction`` at ``precision`` (None for the reference itself)."""
        return next((m for m in self.measurements if (m.direction, m.precision) == (direction, precision)), None)


@dataclass
class PrecisionPlan:
    """Per-layer forward/backward precisions with the measured numbers; JSON-serializable."""

    backend: str
    reference: str
    budget: float
    cost_model: str
    layers: dict[str, LayerPlan]
    estimated_error: float = 0.0  # sum of the chosen per-(layer, direction) errors
    verified: dict[str, float] = field(default_factory=dict)  # drift of the whole plan, measured in one run

    def precisions(self, name: str) -> tuple[str, str]:
        """(precision_fwd, precision_bwd) for layer ``name``; the reference for unknown layers."""
        lp = self.layers.get(name)
        return (lp.precision_fwd, lp.precision_bwd) if lp else (self.reference, self.reference)

    def weight_bytes(self) -> int:
        """Weight bytes the plan stores (one copy per distinct storage format per layer)."""
        return sum(_bytes(lp.shape, lp.precision_fwd, lp.precision_bwd) for lp in self.layers.values())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (inverse of ``from_dict``)."""
        return {
            "version": PLAN_VERSION,
            "backend": self.backend,
            "reference": self.reference,
            "budget": self.budget,
            "cost_model": self.cost_model,
            "estimated_error": self.estimated_error,
            "verified": dict(self.verified),
            "layers": [
                {
                    "name": lp.name,
                    "shape": list(lp.shape),
                    "precision_fwd": lp.precision_fwd,
                    "precision_bwd": lp.precision_bwd,
                    "measurements": [_json_floats(asdict(m)) for m in lp.measurements],
                }
                for lp in self.layers.values()
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrecisionPlan:
        """Rebuild a plan written by ``to_dict`` (raises ValueError on another format version)."""
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"precision plan version {d.get('version')!r} is not {PLAN_VERSION}; re-run the planner")
        layers = {
            lay["name"]: LayerPlan(
                lay["name"],
                (int(lay["shape"][0]), int(lay["shape"][1])),
                lay["precision_fwd"],
                lay["precision_bwd"],
                [Measurement(**{k: _from_json(v) for k, v in m.items()}) for m in lay["measurements"]],
            )
            for lay in d["layers"]
        }
        return cls(
            d["backend"], d["reference"], float(d["budget"]), d["cost_model"], layers,
            float(d["estimated_error"]), {k: float(v) for k, v in d.get("verified", {}).items()},
        )  # fmt: skip

    def table(self) -> str:
        """Human-readable table: one row per layer and direction with the measured error per precision."""
        precs = sorted({m.precision for lp in self.layers.values() for m in lp.measurements}, key=_FORMAT_ORDER)
        head = f"{'layer':<32} {'shape':>11} {'dir':<3} {'chosen':<6} " + " ".join(f"{p:>16}" for p in precs)
        lines = [
            f"precision plan: backend={self.backend} reference={self.reference} budget={self.budget:g} "
            f"cost={self.cost_model} estimated_error={self.estimated_error:.3e} "
            f"weight_bytes={self.weight_bytes()}",
            "cells: rel error (max of dA, dB, dX) / cosine of dA",
            head,
            "-" * len(head),
        ]
        for lp in self.layers.values():
            for direction, chosen in (("fwd", lp.precision_fwd), ("bwd", lp.precision_bwd)):
                cells = []
                for p in precs:
                    m = lp.measured(direction, p)
                    cells.append(f"{m.error:9.2e}/{m.cos_da:6.4f}" if m else f"{'-':>16}")
                shape = f"{lp.shape[0]}x{lp.shape[1]}"
                lines.append(f"{lp.name[:32]:<32} {shape:>11} {direction:<3} {chosen:<6} " + " ".join(cells))
        if self.verified:
            lines.append("whole plan, measured: " + ", ".join(f"{k}={v:.3e}" for k, v in self.verified.items()))
        return "\n".join(lines)


def _FORMAT_ORDER(p: str) -> int:  # noqa: N802 (used as a sort key)
    return list(BYTES_PER_WEIGHT).index(p)


def _json_floats(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _from_json(v: Any) -> Any:
    return float("nan") if v is None else v


def _bytes(shape: tuple[int, int], pf: str, pb: str) -> int:
    n = shape[0] * shape[1]
    formats = {_FORMAT[pf]: pf, _FORMAT[pb]: pb}
    return int(sum(BYTES_PER_WEIGHT[p] * n for p in formats.values()))


def _flat_grads(model: nn.Module, attr: str) -> Tensor:
    gs = [getattr(m, attr).grad.reshape(-1) for m in model.modules() if isinstance(m, LoRALinear) and m.rank > 0]
    return torch.cat(gs) if gs else torch.zeros(0)


def _drift(got: Tensor, ref: Tensor) -> tuple[float, float]:
    if ref.numel() == 0 or float(ref.norm()) == 0.0:
        return float("nan"), float("nan")
    cos = float(torch.nn.functional.cosine_similarity(got.reshape(1, -1), ref.reshape(1, -1)).item())
    return cos, float((got - ref).norm() / ref.norm())


def _grads_run(model: nn.Module, loss_fn: Callable[[], Tensor], probe: LoRALinear | None) -> tuple[Tensor, ...]:
    """One fwd+bwd on the calibration batch; returns (dA, dB, dX at ``probe``'s input)."""
    for p in model.parameters():
        p.grad = None
    captured: list[Tensor] = []

    def pre_hook(_mod: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
        if not args[0].requires_grad:
            return None
        x = args[0].view_as(args[0])  # a fresh node: its gradient is this layer's dX only, not its siblings'
        x.register_hook(lambda g: captured.append(g.detach().clone()))
        return (x, *args[1:])

    handle = probe.register_forward_pre_hook(pre_hook) if probe is not None else None
    try:
        loss_fn().backward()
    finally:
        if handle is not None:
            handle.remove()
    dx = captured[0] if captured else torch.zeros(0)
    return _flat_grads(model, "lora_A").clone(), _flat_grads(model, "lora_B").clone(), dx


def _time_ms(fn: Callable[[Tensor], Tensor], a: Tensor, repeats: int = 3) -> float:
    fn(a)  # first call may build a bucket session
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(a)
    return (time.perf_counter() - t0) / repeats * 1e3


def plan_precision(
    model: nn.Module,
    loss_fn: Callable[[], Tensor],
    weights: Mapping[str, tuple[Tensor, Tensor | None]],
    *,
    backend: str = "torch",
    reference: str = "fp32",
    candidates: Sequence[str] = ("fp16", "w8a16", "w8a8"),
    budget: float = 0.05,
    max_layer_error: float = 0.1,
    cost: str = "bytes",
    calib_tokens: int = 256,
    verify: bool = True,
) -> PrecisionPlan:
    """Choose per-layer forward/backward precisions by how much they move the LoRA gradients.

    For every LoRALinear named in ``weights`` and every candidate, that layer alone (one direction at a time) is
    rebuilt at the candidate precision; one fwd+bwd of ``loss_fn`` measures cosine and relative-norm error of all
    dA, all dB and the layer's own input gradient dX against the ``reference`` run. The cheapest plan whose summed
    error stays within ``budget`` is then chosen (multiple-choice knapsack solved by a Lagrangian sweep).

    Args:
        model: module containing LoRALinear layers (their ``frozen`` is swapped during planning, then restored).
        loss_fn: runs the model on the calibration batch and returns the scalar loss.
        weights: module name (as in ``model.named_modules()``) -> (W [out, in], bias) of the frozen linear.
        backend: backend to measure on ("torch" emulates every precision on any host).
        reference: the highest precision, measured against.
        candidates: precisions to try; those the backend lacks are skipped.
        budget: allowed sum over (layer, direction) of the measured error.
        max_layer_error: a single (layer, direction) above this error is never lowered.
        cost: "bytes" (weight bytes stored) or "time" (measured fwd+bwd ms of the frozen product).
        calib_tokens: rows used for the time cost model.
        verify: run the chosen plan once and record its whole-model drift in ``plan.verified``.

    Returns:
        The PrecisionPlan (the model is left with its original frozen linears).

    Raises:
        ValueError: unknown cost model, or a name in ``weights`` that is not a LoRALinear of ``model``.
    """
    if cost not in ("bytes", "time"):
        raise ValueError(f"cost must be 'bytes' or 'time', got {cost!r}")
    mods = dict(model.named_modules())
    layers: dict[str, LoRALinear] = {}
    for name in weights:
        mod = mods.get(name)
        if not isinstance(mod, LoRALinear):
            raise ValueError(f"{name!r} is not a LoRALinear in the model; pass names from model.named_modules()")
        layers[name] = mod
    originals = {n: m.frozen for n, m in layers.items()}
    was_training = model.training
    model.train(False)  # dropout off: the drift must come from precision only

    def build(name: str, pf: str, pb: str) -> Any:
        w, b = weights[name]
        return make_frozen_linear(w, b, backend=backend, precision=pf, precision_bwd=pb, name=name)

    try:
        ref_frozen = {n: build(n, reference, reference) for n in layers}
        for n, m in layers.items():
            m.frozen = ref_frozen[n]
        ref_a, ref_b, _ = _grads_run(model, loss_fn, None)
        plans: dict[str, LayerPlan] = {}
        for n, m in layers.items():
            lp = LayerPlan(n, (m.out_features, m.in_features), reference, reference)
            _, _, ref_x = _grads_run(model, loss_fn, m)
            for p in candidates:
                if p == reference:
                    continue
                for direction in ("fwd", "bwd"):
                    try:
                        fl = build(n, p, reference) if direction == "fwd" else build(n, reference, p)
                    except ValueError:
                        continue  # backend lacks this precision
                    m.frozen = fl
                    da, db, dx = _grads_run(model, loss_fn, m)
                    m.frozen = ref_frozen[n]
                    (ca, ra), (cb, rb), (cx, rx) = _drift(da, ref_a), _drift(db, ref_b), _drift(dx, ref_x)
                    t_ms = float("nan")
                    if cost == "time":
                        width = m.in_features if direction == "fwd" else m.out_features
                        op = fl.forward if direction == "fwd" else fl.input_grad
                        t_ms = _time_ms(op, torch.randn(calib_tokens, width))
                    lp.measurements.append(Measurement(direction, p, ca, cb, cx, ra, rb, rx, t_ms))
            plans[n] = lp
            log.info("precision_layer_measured", layer=n, candidates=len(lp.measurements))
        ref_time = _reference_times(layers, ref_frozen, calib_tokens) if cost == "time" else {}
        est = _choose(
            plans, reference=reference, budget=budget, max_layer_error=max_layer_error, cost=cost, ref_time=ref_time
        )
        plan = PrecisionPlan(backend, reference, budget, cost, plans, est)
        if verify:
            for n, m in layers.items():
                m.frozen = build(n, *plan.precisions(n))
            da, db, _ = _grads_run(model, loss_fn, None)
            (ca, ra), (cb, rb) = _drift(da, ref_a), _drift(db, ref_b)
            plan.verified = {"cos_da": ca, "rel_da": ra, "cos_db": cb, "rel_db": rb}
    finally:
        for n, m in layers.items():
            m.frozen = originals[n]
        model.train(was_training)
        for p in model.parameters():
            p.grad = None
    log.info("precision_plan_ready", layers=len(plans), estimated_error=est, weight_bytes=plan.weight_bytes())
    return plan


def _reference_times(layers: Mapping[str, LoRALinear], frozen: Mapping[str, Any], t: int) -> dict[str, float]:
    out = {}
    for n, m in layers.items():
        out[f"{n}|fwd"] = _time_ms(frozen[n].forward, torch.randn(t, m.in_features))
        out[f"{n}|bwd"] = _time_ms(frozen[n].input_grad, torch.randn(t, m.out_features))
    return out


def _choose(
    plans: dict[str, LayerPlan],
    *,
    reference: str,
    budget: float,
    max_layer_error: float,
    cost: str,
    ref_time: Mapping[str, float],
) -> float:
    """Set each LayerPlan's precisions to the cheapest combination within ``budget``; returns its summed error."""
    options: dict[str, list[tuple[float, float, str, str]]] = {}  # name -> [(cost, error, fwd, bwd)]
    for n, lp in plans.items():
        fwd = [(reference, 0.0, ref_time.get(f"{n}|fwd", 0.0))]
        bwd = [(reference, 0.0, ref_time.get(f"{n}|bwd", 0.0))]
        for m in lp.measurements:
            if m.error <= max_layer_error and not math.isnan(m.error):
                (fwd if m.direction == "fwd" else bwd).append((m.precision, m.error, m.time_ms))
        opts = []
        for pf, ef, tf in fwd:
            for pb, eb, tb in bwd:
                c = float(_bytes(lp.shape, pf, pb)) if cost == "bytes" else tf + tb
                opts.append((c, ef + eb, pf, pb))
        options[n] = opts

    def pick(lam: float) -> tuple[float, dict[str, tuple[float, float, str, str]]]:
        chosen = {n: min(o, key=lambda t: (t[0] + lam * t[1], t[1])) for n, o in options.items()}
        return sum(c[1] for c in chosen.values()), chosen

    # Larger λ buys accuracy; bisect (log scale) for the smallest λ whose plan fits the budget.
    lo, hi = 1e-12, 1e18
    err, best = pick(hi)
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        e, ch = pick(mid)
        if e <= budget:
            hi, err, best = mid, e, ch
        else:
            lo = mid
    for n, (_, _, pf, pb) in best.items():
        plans[n].precision_fwd, plans[n].precision_bwd = pf, pb
    return err
