"""Fast planner internals: one reference fwd+bwd with captured x/dy, local per-layer drifts, verify and back off."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch import Tensor

from lorad.kernels.plan import LayerPlan, Measurement

if TYPE_CHECKING:
    from lorad.kernels.costs import CostTable

log = structlog.get_logger(__name__)


class Slot:
    """A FrozenLinear stand-in installed at every site of one layer during planning.

    ``forward`` runs ``fwd_impl`` and ``input_grad`` runs ``bwd_impl`` (so a plan with different forward and
    backward precisions needs no new sessions), and while ``recording`` (the reference run, both impls the
    reference) it keeps copies of every input it sees and of what the reference made of it: the layer's input x and
    output y (forward), its output gradient dy and input gradient dX (input_grad). Copies, because the LoRA ops add
    their terms into y and dX in place.
    """

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self.fwd_impl, self.bwd_impl = ref, ref
        self.in_features, self.out_features = ref.in_features, ref.out_features
        self.name = ref.name
        self.runs_on_cpu = bool(getattr(ref, "runs_on_cpu", False))
        self.recording = False
        self.record_fwd = True  # off during backward: a recomputing loss must not record x twice
        self.xs: list[Tensor] = []
        self.ys: list[Tensor] = []
        self.dys: list[Tensor] = []
        self.dxs: list[Tensor] = []

    @property
    def precision_fwd(self) -> str:
        return str(self.fwd_impl.precision_fwd)

    @property
    def precision_bwd(self) -> str:
        return str(self.bwd_impl.precision_bwd)

    @property
    def nbytes(self) -> int:
        return int(self.ref.nbytes)

    def forward(self, x: Tensor) -> Tensor:
        record = self.recording and self.record_fwd
        if record:
            self.xs.append(x.detach().clone())
        out: Tensor = self.fwd_impl.forward(x)
        if record:
            self.ys.append(out.detach().clone())
        return out

    def input_grad(self, dy: Tensor) -> Tensor:
        if self.recording:
            self.dys.append(dy.detach().clone())
        out: Tensor = self.bwd_impl.input_grad(dy)
        if self.recording:
            self.dxs.append(out.detach().clone())
        return out

    def captured(self) -> tuple[Tensor, Tensor]:
        """All recorded x rows [N, in] and dy rows [M, out] (empty when the layer was not reached)."""
        x = _joined(self.xs, self.in_features)
        dy = _joined(self.dys, self.out_features)
        return x, dy


def _joined(rows: list[Tensor], width: int) -> Tensor:
    if len(rows) == 1:
        return rows[0]  # already a private copy: a cat would copy it again
    return torch.cat(rows) if rows else torch.zeros(0, width)


def drift(got: Tensor, ref: Tensor) -> tuple[float, float]:
    """(cosine, relative norm error) of ``got`` vs ``ref``; NaNs when ``ref`` is empty or zero."""
    rn = float(ref.norm()) if ref.numel() else 0.0
    if rn == 0.0:
        return float("nan"), float("nan")
    # Cosine by the law of cosines from three norms (float64 arithmetic on fp32-accumulated norms): a third of the
    # time of cosine_similarity here, and exact to ~1e-9 where cosine_similarity's fp32 dot reads 1.0001 on 4M values.
    gn, dn = float(got.norm()), float((got - ref).norm())
    cos = (gn * gn + rn * rn - dn * dn) / (2 * gn * rn) if gn > 0 else 0.0
    return max(-1.0, min(1.0, cos)), dn / rn


def nanmax(*vals: float) -> float:
    """Largest non-NaN value (0.0 when all are NaN): a zero reference (dA while B = 0) must not hide the rest."""
    ok = [v for v in vals if not math.isnan(v)]
    return max(ok) if ok else 0.0


def whole_drift(da: Tensor, db: Tensor, ref_a: Tensor, ref_b: Tensor) -> dict[str, float]:
    """Drift of all adapters' dA and dB at once, plus ``error`` = the larger relative error."""
    (ca, ra), (cb, rb) = drift(da, ref_a), drift(db, ref_b)
    return {"cos_da": ca, "rel_da": ra, "cos_db": cb, "rel_db": rb, "error": nanmax(ra, rb)}


def time_ms(fn: Callable[[Tensor], Tensor], a: Tensor) -> float:
    """Wall time of one call after a warm-up call (ms)."""
    fn(a)
    t0 = time.perf_counter()
    fn(a)
    return (time.perf_counter() - t0) * 1e3


def reference_products(slot: Slot, x: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """The reference layer's output on the captured x and input gradient on the captured dy, compared with every
    candidate: the very products of the reference run, recorded with x and dy (computing them again was ~0.9 s of
    fp32 GEMMs on SmolLM2); computed here only for rows recorded without them."""
    if len(slot.ys) == len(slot.xs) and len(slot.dxs) == len(slot.dys):
        return _joined(slot.ys, slot.out_features), _joined(slot.dxs, slot.in_features)
    with torch.no_grad():
        y = slot.ref.forward(x) if x.numel() else x.new_zeros(0)
        dx = slot.ref.input_grad(dy) if dy.numel() else dy.new_zeros(0)
    return y, dx


def local_drifts(
    cand: Any, x: Tensor, dy: Tensor, ref: tuple[Tensor, Tensor]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """((cos_y, rel_y), (cos_dx, rel_dx)) of ``cand`` vs the reference products ``ref`` on the captured x and dy.

    The forward drift is measured on the frozen product alone (bias excluded would hide nothing: it is exact).
    """
    nan = (float("nan"), float("nan"))
    with torch.no_grad():
        fwd = drift(cand.forward(x), ref[0]) if x.numel() else nan
        bwd = drift(cand.input_grad(dy), ref[1]) if dy.numel() else nan
    return fwd, bwd


def measure_locally(
    name: str,
    slot: Slot,
    *,
    reference: str,
    candidates: Sequence[str],
    build: Callable[[str, str, str], Any],
    cost: str,
    costs: CostTable | None,
    ref_time: dict[str, float],
    impls: dict[tuple[str, str], Any],
    drifts: bool = True,
) -> LayerPlan:
    """One layer's plan with a local fwd and bwd Measurement per candidate (on the rows ``slot`` recorded).

    A candidate the measured cost table does not price below the reference is skipped. Each candidate is built once
    (into ``impls``, for the whole-model runs) and ``ref_time`` gets the layer's reference ms (cost "time" and
    "measured"). ``drifts=False`` (a dominant layer, measured globally afterwards) leaves the drifts NaN: on
    SmolLM2's lm_head its products are six 256x576x49152 GEMMs (~0.7 s) whose result no decision reads.
    """
    x, dy = slot.captured()
    shape = (slot.out_features, slot.in_features)
    lp = LayerPlan(name, shape, reference, reference)
    ref_products: tuple[Tensor, Tensor] | None = None
    if cost == "time":
        ref_time[f"{name}|fwd"] = time_ms(slot.ref.forward, x) if x.numel() else 0.0
        ref_time[f"{name}|bwd"] = time_ms(slot.ref.input_grad, dy) if dy.numel() else 0.0
    elif cost == "measured" and costs is not None:
        ref_time[f"{name}|fwd"] = costs.get(shape, reference, "fwd")
        ref_time[f"{name}|bwd"] = costs.get(shape, reference, "bwd")
    nan = float("nan")
    for p in candidates:
        if p == reference:
            continue
        if cost == "measured" and costs is not None:
            ref_ms = ref_time[f"{name}|fwd"] + ref_time[f"{name}|bwd"]
            if costs.get(shape, p, "fwd") + costs.get(shape, p, "bwd") >= ref_ms:
                continue  # never assumed faster than it measures
        try:
            cand = build(name, p, p)  # one object serves both directions' measurements
        except ValueError:
            continue  # backend lacks this precision
        impls[(name, p)] = cand
        (cy, ry), (cx, rx) = (nan, nan), (nan, nan)
        if drifts:
            if ref_products is None:
                ref_products = reference_products(slot, x, dy)
            (cy, ry), (cx, rx) = local_drifts(cand, x, dy, ref_products)
        tf = time_ms(cand.forward, x) if cost == "time" and x.numel() else nan
        tb = time_ms(cand.input_grad, dy) if cost == "time" and dy.numel() else nan
        if cost == "measured" and costs is not None:
            tf, tb = costs.get(shape, p, "fwd"), costs.get(shape, p, "bwd")
        lp.measurements.append(Measurement("fwd", p, nan, nan, nan, nan, nan, nan, tf, cy, ry, local=True))
        lp.measurements.append(Measurement("bwd", p, nan, nan, cx, nan, nan, rx, tb, local=True))
    slot.xs, slot.ys, slot.dys, slot.dxs = [], [], [], []
    return lp


def raise_worst(lowered: Sequence[tuple[float, str, str]], sum_sq: float, target_sq: float) -> list[tuple[str, str]]:
    """The fewest (layer, direction) entries, worst local error first, whose removal brings Σe² to ``target_sq``.

    Args:
        lowered: (local error, layer, direction) of every entry the plan runs below the reference.
        sum_sq: Σe² of the plan now.
        target_sq: the Σe² to reach.

    Returns:
        The entries to put back to the reference (at least one when anything is lowered).
    """
    out: list[tuple[str, str]] = []
    for e, name, direction in sorted(lowered, reverse=True):
        if out and sum_sq <= target_sq:
            break
        out.append((name, direction))
        sum_sq -= e * e
    return out


def apply_choice(slots: Mapping[str, Slot], impls: Mapping[tuple[str, str], Any], choice: Mapping[str, Any]) -> None:
    """Point each slot's forward/backward at the objects of the chosen precisions (``impls[(name, precision)]``)."""
    for n, s in slots.items():
        pf, pb = choice[n]
        s.fwd_impl = impls.get((n, pf), s.ref)
        s.bwd_impl = impls.get((n, pb), s.ref)


def measure_globally(
    lp: LayerPlan,
    names: Iterable[str],
    *,
    reference: str,
    one_copy: bool,
    run: Callable[[Mapping[str, tuple[str, str]]], dict[str, float]],
    tick: Callable[[], None],
) -> None:
    """Replace a dominant layer's local measurements by whole-model dA/dB drifts (every other layer at the reference).

    Per direction: one run per (candidate, direction) with only that direction lowered. A one-copy plan only ever runs
    both directions of a layer at one precision, so there each candidate gets ONE run with both lowered, the very
    configuration the plan would train with (SmolLM2's lm_head: 2 whole fwd+bwd of ~2 s instead of 4); its fwd and
    bwd entries both hold that run's drift, marked ``joint`` (``Measurement.joint_share`` splits its square).

    Args:
        lp: the dominant layer's plan, with its local measurements (replaced in place).
        names: every planned layer.
        reference: the reference precision.
        one_copy: measure both directions together (one run per candidate).
        run: one whole-model fwd+bwd with layer -> (fwd, bwd) precisions; returns ``whole_drift``'s dict.
        tick: called before each run (progress).
    """
    nan = float("nan")
    base = {x: (reference, reference) for x in names}
    out: list[Measurement] = []
    if one_copy:
        for p in dict.fromkeys(m.precision for m in lp.measurements):
            mf, mb = lp.measured("fwd", p), lp.measured("bwd", p)
            tick()
            g = run({**base, lp.name: (p, p)})
            for m in (mf, mb):
                if m is not None:
                    out.append(Measurement(m.direction, p, g["cos_da"], g["cos_db"], m.cos_dx, g["rel_da"], g["rel_db"],
                                           nan, m.time_ms, m.cos_y, m.rel_y, local=False, joint=True))  # fmt: skip
    else:
        for m in lp.measurements:
            tick()
            pair = (m.precision, reference) if m.direction == "fwd" else (reference, m.precision)
            g = run({**base, lp.name: pair})
            out.append(Measurement(m.direction, m.precision, g["cos_da"], g["cos_db"], m.cos_dx, g["rel_da"],
                                   g["rel_db"], nan, m.time_ms, m.cos_y, m.rel_y, local=False))  # fmt: skip
    lp.measurements = out
