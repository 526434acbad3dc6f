"""The precision plan: per-layer forward/backward precisions with the measurements behind them; JSON and a table."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from lorad.kernels._quant import BYTES_PER_WEIGHT

PLAN_VERSION = 2  # 2: fast (local) mode fields; version-1 plans still load
# Bumped whenever a change in how plans are measured or chosen would choose differently (part of cache keys).
PLANNER_VERSION = "3.11"  # 3.11: a plan verified below REFINE_BELOW of the budget is chosen again (planner.REFINE_AIM).
# 3.10: priced with cost tables of torch w8a8 with fused quantization (costs 7).
# 3.9: ort-cpu w8a8 stored as uint8 on x86 without VNNI (int16 saturation gone).
# 3.8: COST_MARGIN 0.25 (and costs.PASSES: cost tables timed in three passes).
# 3.7: measured costs priced per weight of each precision pair; FIRST_AIM 0.6.
# 3.6: the first plan aims at planner.FIRST_AIM of the budget.
# 3.5: a cheaper option must beat a more accurate one by planner.COST_MARGIN.
# 3.4: one-copy calibration only at precisions admissible in both directions.
# 3.3: one-copy plans measure a dominant layer once per candidate, both directions low.
# 3.2: training attention in bf16 when the layer runs below fp32.
# 3.1: one weight copy per layer (both directions at one precision); torch int8 w8a8.
# 3.0: measured per-shape cost model, bf16, fixed calibration text + seeded adapter
# Weight storage format per precision: two precisions with one format share one stored copy.
_FORMAT = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "w8a16": "int8", "w8a8": "int8", "w4a16": "int4"}


def shares_copy(precision_fwd: str, precision_bwd: str) -> bool:
    """True when one stored weight copy serves both precisions (same storage format, e.g. w8a16 and w8a8)."""
    return _FORMAT[precision_fwd] == _FORMAT[precision_bwd]


FAST_NOTE = (
    "fast mode: cells are LOCAL drifts from one reference fwd+bwd with each layer's input x and output gradient "
    "dy captured: fwd = rel error of the layer's frozen output on its captured x, bwd = rel error of its input "
    "gradient dX on its captured dy (a layer's own dA/dB depend on x and dy only, so these are its whole local "
    "effect; how they propagate is not measured per layer). A layer holding a large share of the weights is "
    "measured globally instead (rel error of all dA/dB after a whole-model run; in one-copy plans one run per "
    "precision with both directions lowered, shown in both rows). The budget is enforced on the whole plan's measured "
    "dA/dB drift ('whole plan' line), backing off the worst layers when it is exceeded."
)


def _nanmax(*vals: float) -> float:
    ok = [v for v in vals if not math.isnan(v)]
    return max(ok) if ok else 0.0


@dataclass(frozen=True)
class Measurement:
    """Drift when one layer's one direction runs at ``precision`` (all else at the reference).

    Exact mode (``local=False``): cos/rel of all adapters' dA and dB and of the layer's dX after a full fwd+bwd.
    Fast mode (``local=True``): cos/rel of the layer's output y (fwd) or input gradient dX (bwd) on captured inputs.
    Fast mode, one-copy plan, dominant layer (``joint=True``): the fwd and the bwd entry both hold the dA/dB drift of
    ONE whole-model run with both directions of the layer at ``precision`` (see ``joint_share``).
    """

    direction: str  # "fwd" | "bwd"
    precision: str
    cos_da: float
    cos_db: float
    cos_dx: float
    rel_da: float
    rel_db: float
    rel_dx: float
    time_ms: float = float("nan")  # measured frozen-product time on the calibration shape (cost="time")
    cos_y: float = float("nan")
    rel_y: float = float("nan")
    local: bool = False
    joint: bool = False

    @property
    def joint_share(self) -> float:
        """The share of the squared error this entry carries when errors are summed as Σe² over directions.

        A joint entry's drift E was measured once for both directions together; its fwd and bwd entries carry E²/2
        each, so the layer at ``precision`` (both entries, as a one-copy plan always takes them) adds exactly the
        measured E² and never twice. ``error`` stays E: the per-entry ``max_layer_error`` check compares the whole
        measured drift, at least either direction's own, so it is no looser than two per-direction runs were.
        """
        return 0.5 if self.joint else 1.0

    @property
    def error(self) -> float:
        """The scalar the budget is spent on: worst relative error of what was measured (NaNs = not measured)."""
        if self.local:
            return _nanmax(self.rel_y, self.rel_dx)
        return _nanmax(self.rel_da, self.rel_db, self.rel_dx)

    @property
    def cos(self) -> float:
        """The cosine shown next to the error: dA's (exact mode) or the measured local tensor's (fast mode)."""
        if self.local:
            return self.cos_y if self.direction == "fwd" else self.cos_dx
        return self.cos_da


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
    estimated_error: float = 0.0  # exact: sum of chosen per-(layer, direction) errors; fast: predicted whole drift
    verified: dict[str, float] = field(default_factory=dict)  # drift of the whole plan, measured in one run
    mode: str = "exact"  # "exact" | "fast"
    calibration: dict[str, float] = field(default_factory=dict)  # fast: scale from local Σe² to whole drift
    history: list[dict[str, float]] = field(default_factory=list)  # fast: one entry per verify run
    seconds: float = float("nan")  # wall time of planning
    planner_version: str = PLANNER_VERSION
    costs: dict[str, float] = field(default_factory=dict)  # cost="measured": "<out>x<in>|<prec>|<dir>" -> ms per call

    def precisions(self, name: str) -> tuple[str, str]:
        """(precision_fwd, precision_bwd) for layer ``name``; the reference for unknown layers."""
        lp = self.layers.get(name)
        return (lp.precision_fwd, lp.precision_bwd) if lp else (self.reference, self.reference)

    def weight_bytes(self) -> int:
        """Weight bytes the plan stores (one copy per distinct storage format per layer)."""
        return sum(weight_bytes(lp.shape, lp.precision_fwd, lp.precision_bwd) for lp in self.layers.values())

    def summary(self) -> dict[str, Any]:
        """Counts of layers per (fwd/bwd) precision, bytes, verified drift, mode and planning time (for logs/UI)."""
        counts = Counter(f"{lp.precision_fwd}/{lp.precision_bwd}" for lp in self.layers.values())
        ref_bytes = sum(weight_bytes(lp.shape, self.reference, self.reference) for lp in self.layers.values())
        return {
            "mode": self.mode,
            "layers": len(self.layers),
            "precisions": dict(sorted(counts.items())),
            "weight_bytes": self.weight_bytes(),
            "reference_weight_bytes": ref_bytes,
            "verified_error": self.verified.get("error", float("nan")),
            "calibration": {k: round(v, 4) for k, v in self.calibration.items()},
            "budget": self.budget,
            "seconds": round(self.seconds, 2),
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (inverse of ``from_dict``)."""
        return {
            "version": PLAN_VERSION,
            "planner_version": self.planner_version,
            "mode": self.mode,
            "backend": self.backend,
            "reference": self.reference,
            "budget": self.budget,
            "cost_model": self.cost_model,
            "estimated_error": _json_float(self.estimated_error),
            "verified": _json_floats(dict(self.verified)),
            "calibration": _json_floats(dict(self.calibration)),
            "history": [_json_floats(dict(h)) for h in self.history],
            "seconds": _json_float(self.seconds),
            "costs": _json_floats(dict(self.costs)),
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
        """Rebuild a plan written by ``to_dict`` (versions 1 and 2).

        Raises:
            ValueError: another format version, or a malformed plan (the message says what is wrong).
        """
        if d.get("version") not in (1, PLAN_VERSION):
            raise ValueError(f"precision plan version {d.get('version')!r} is not {PLAN_VERSION}; re-run the planner")
        try:
            layers = {
                lay["name"]: LayerPlan(
                    lay["name"],
                    (int(lay["shape"][0]), int(lay["shape"][1])),
                    str(lay["precision_fwd"]),
                    str(lay["precision_bwd"]),
                    [Measurement(**{k: _from_json(v) for k, v in m.items()}) for m in lay["measurements"]],
                )
                for lay in d["layers"]
            }
            return cls(
                str(d["backend"]), str(d["reference"]), float(d["budget"]), str(d["cost_model"]), layers,
                float(_from_json(d["estimated_error"])), _floats(d.get("verified", {})), str(d.get("mode", "exact")),
                _floats(d.get("calibration", {})), [_floats(h) for h in d.get("history", [])],
                float(_from_json(d.get("seconds"))), str(d.get("planner_version", "1")), _floats(d.get("costs", {})),
            )  # fmt: skip
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"malformed precision plan: {type(e).__name__}: {e}") from e

    def table(self) -> str:
        """Human-readable table: one row per layer and direction with the measured error per precision."""
        precs = sorted({m.precision for lp in self.layers.values() for m in lp.measurements}, key=_format_order)
        head = f"{'layer':<32} {'shape':>11} {'dir':<3} {'chosen':<6} " + " ".join(f"{p:>16}" for p in precs)
        cells_note = (
            "cells: local rel error (fwd: y, bwd: dX) / its cosine"
            if self.mode == "fast"
            else "cells: rel error (max of dA, dB, dX) / cosine of dA"
        )
        lines = [
            f"precision plan: mode={self.mode} backend={self.backend} reference={self.reference} "
            f"budget={self.budget:g} cost={self.cost_model} estimated_error={self.estimated_error:.3e} "
            f"weight_bytes={self.weight_bytes()}",
            *([FAST_NOTE] if self.mode == "fast" else []),
            cells_note,
            head,
            "-" * len(head),
        ]
        for lp in self.layers.values():
            for direction, chosen in (("fwd", lp.precision_fwd), ("bwd", lp.precision_bwd)):
                cells = []
                for p in precs:
                    m = lp.measured(direction, p)
                    cells.append(f"{m.error:9.2e}/{m.cos:6.4f}" if m else f"{'-':>16}")
                shape = f"{lp.shape[0]}x{lp.shape[1]}"
                lines.append(f"{lp.name[:32]:<32} {shape:>11} {direction:<3} {chosen:<6} " + " ".join(cells))
        if self.costs:
            lines.append(
                "measured cost per call (ms): " + ", ".join(f"{k}={v:.2f}" for k, v in sorted(self.costs.items()))
            )
        if self.calibration:
            lines.append("calibration: " + ", ".join(f"{k}={v:.3e}" for k, v in self.calibration.items()))
        for h in self.history:
            lines.append("verify run: " + ", ".join(f"{k}={v:.3e}" for k, v in h.items()))
        if self.verified:
            lines.append("whole plan, measured: " + ", ".join(f"{k}={v:.3e}" for k, v in self.verified.items()))
        return "\n".join(lines)


def weight_bytes(shape: tuple[int, int], pf: str, pb: str) -> int:
    """Bytes stored for one [out, in] weight run at (pf, pb): one copy per distinct storage format."""
    n = shape[0] * shape[1]
    formats = {_FORMAT[pf]: pf, _FORMAT[pb]: pb}
    return int(sum(BYTES_PER_WEIGHT[p] * n for p in formats.values()))


def _format_order(p: str) -> int:
    return list(BYTES_PER_WEIGHT).index(p)


def _json_float(v: float) -> float | None:
    return None if math.isnan(v) else v


def _json_floats(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _from_json(v: Any) -> Any:
    return float("nan") if v is None else v


def _floats(d: Mapping[str, Any]) -> dict[str, float]:
    return {str(k): float(_from_json(v)) for k, v in d.items()}
