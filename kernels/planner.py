"""Precision planner by gradient sensitivity: choose per-layer fwd/bwd precisions that keep dA/dB within a budget.

Two modes: ``exact`` lowers one layer and direction at a time and runs a full fwd+bwd for each (hundreds of passes
on a 30-layer model); ``fast`` (the product default) runs one reference fwd+bwd, measures every layer locally on its
captured inputs, and verifies the chosen whole plan with real runs (see ``plan_precision``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
import torch
from torch import Tensor, nn

from lorad.kernels import _plan_fast as fast
from lorad.kernels._swap import Site, frozen_sites, set_frozen
from lorad.kernels.costs import CostTable
from lorad.kernels.frozen import make_frozen_linear
from lorad.kernels.lora import LoRALinear
from lorad.kernels.plan import (
    PLAN_VERSION,
    PLANNER_VERSION,
    LayerPlan,
    Measurement,
    PrecisionPlan,
    shares_copy,
    weight_bytes,
)

log = structlog.get_logger(__name__)

__all__ = ["PLANNER_VERSION", "PLAN_VERSION", "LayerPlan", "Measurement", "PrecisionPlan", "plan_precision"]
MODES = ("fast", "exact")
COSTS = ("bytes", "time", "measured")
COST_MARGIN = 0.25
"""With a timed cost ("time", "measured"), a less accurate option is chosen over a more accurate one only when it
costs more than this share less (here: w8a8 must time at most 0.8 of bf16). Measured on SmolLM2 (2 threads, Zen 5):
the table, timing each product alone, prices w8a8 at 0.63-0.73 of bf16 on the block shapes and the lm_head and at
0.82-0.85 on k/v's 192x576 (five fresh tables, ``costs.PASSES`` and ``costs.MIN_ROUND_MS``), yet a whole training
step with every layer at w8a8 is only 9-15 % faster than all-bf16 (interleaved steps, one process). At 0.2 the line
sat at 0.83, inside k/v's spread, so fresh plans of one model took 14 or 26 int8 layers by whether k/v's int8 was
admitted; 0.8 lies between the two groups, and the five fresh plans were one plan (26 int8 layers)."""


FIRST_AIM = 0.6
"""The first chosen plan aims at this share of the budget. k is measured on the cheapest plan, whose drift is mostly
int8's small layers; the plans chosen from it lower the big MLP layers first, whose drift ran ~1.5x what k predicted
(SmolLM2, budget 0.1: 0.104 measured for 0.069 predicted at 0.7; earlier 0.146 for 0.0999 at 1.0), so the first
verification failed and a back-off run followed (~1 s). At 0.6 three cold plans verified at 0.068 in one run."""


REFINE_AIM = 0.8
"""A plan that verifies below ``REFINE_BELOW`` of the budget is chosen again, aiming at this share of it, with k
measured on that plan itself rather than on the cheapest one: the cheapest plan's drift is mostly the small layers'
(k/v at int8), and its k then priced the big ones too high (SmolLM2, budget 0.1, Zen 5: k 0.75 from the cheapest
plan, a first plan of 8 int8 layers verified at 0.060; chosen again, 14 layers at 0.053, then 31 at 0.068, then 0.125:
refused). A new plan is kept only if its own run verifies it within the budget, else the one before stands; at most
``REFINE_ROUNDS`` times, one fwd+bwd run each (~0.8 s here), paid once per cached plan."""
REFINE_BELOW = 0.7
REFINE_ROUNDS = 3


def worth_their_cost(options: Sequence[tuple[float, float, Any, Any]]) -> list[tuple[float, float, Any, Any]]:
    """The (cost, error, ...) options that no more accurate option matches within ``COST_MARGIN`` of their cost."""
    return [o for o in options if not any(q[1] < o[1] and q[0] <= o[0] * (1 + COST_MARGIN) for q in options)]


def _flat_grads(model: nn.Module, attr: str) -> Tensor:
    gs = [getattr(m, attr).grad.reshape(-1) for m in model.modules() if isinstance(m, LoRALinear) and m.rank > 0]
    return torch.cat(gs) if gs else torch.zeros(0)


def _grads_run(
    model: nn.Module, loss_fn: Callable[[], Tensor], probe: nn.Module | None, slots: Sequence[fast.Slot] = ()
) -> tuple[Tensor, ...]:
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
        loss = loss_fn()
        for s in slots:
            s.record_fwd = False
        loss.backward()
    finally:
        if handle is not None:
            handle.remove()
        for s in slots:
            s.record_fwd = True
    dx = captured[0] if captured else torch.zeros(0)
    return _flat_grads(model, "lora_A").clone(), _flat_grads(model, "lora_B").clone(), dx


def _probe_of(sites: list[Site]) -> LoRALinear | None:
    return next((m for m, _ in sites if isinstance(m, LoRALinear)), None)


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
    mode: str = "fast",
    max_backoff: int = 4,
    exact_share: float = 0.15,
    costs: CostTable | None = None,
    on_progress: Callable[[float], None] | None = None,
    one_copy: bool = False,
) -> PrecisionPlan:
    """Choose per-layer forward/backward precisions by how much they move the LoRA gradients.

    ``mode="exact"``: for every layer, candidate and direction, that layer alone is rebuilt at the candidate and one
    fwd+bwd of ``loss_fn`` measures cosine and relative error of all dA, all dB and the layer's input gradient dX
    against the reference run; the cheapest plan whose summed error stays within ``budget`` is chosen
    (multiple-choice knapsack by a Lagrangian sweep). Cost: 1 + layers·(1 + 2·candidates) passes.

    ``mode="fast"`` (product default): ONE reference fwd+bwd with every layer's input x and output gradient dy
    captured; then per layer and candidate, locally on those tensors: fwd → relative drift of the frozen output y
    (a layer's own dA = s·(dy·B)ᵀx and dB = s·dyᵀ(x·Aᵀ) depend on x and dy only, so its forward precision reaches
    the gradients only through y), bwd → relative drift of its input gradient dX (what every upstream layer sees).
    Approximation: local errors are assumed to add as independent noise, so the whole-plan drift of dA/dB is
    predicted as k·sqrt(Σe²); k is calibrated by one run with every layer at its cheapest admissible candidate,
    and the knapsack spends Σe² ≤ (budget/k)². The chosen plan is then VERIFIED by a real fwd+bwd (cos and rel
    error of all dA, dB); while its error exceeds ``budget``, the worst-measured lowered layers go back to the
    reference and the plan is re-verified (at most ``max_backoff`` times, then everything falls back to the
    reference). Cost: 2 + verify passes plus local products, seconds instead of minutes.

    Args:
        model: module containing the frozen linears (LoRALinear or any module holding a ``frozen`` object); they
            are swapped during planning, then restored.
        loss_fn: runs the model on the calibration batch and returns the scalar loss.
        weights: layer name -> (W [out, in], bias). A name is a LoRALinear's module name or a frozen linear's own
            ``name`` (lorad models: HF module names and ``lm_head``, as ``build_model`` reads plans).
        backend: backend to measure on ("torch" emulates every precision on any host).
        reference: the highest precision, measured against.
        candidates: precisions to try; those the backend lacks are skipped.
        budget: exact: allowed sum over (layer, direction) of the measured error; fast: allowed whole-plan
            relative error of dA/dB (the verified number).
        max_layer_error: a single (layer, direction) above this error is never lowered.
        cost: "bytes" (weight bytes stored), "time" (fwd+bwd ms of each layer timed on the captured rows) or
            "measured" (ms per call from ``costs``, a per-shape table measured once per machine).
        calib_tokens: rows used for the time cost model (exact mode; fast mode times the captured rows).
        verify: exact mode: run the chosen plan once and record its drift (fast mode always verifies).
        mode: "fast" or "exact".
        max_backoff: fast mode: verify/back-off rounds before falling back to the reference.
        exact_share: fast mode: a layer holding at least this share of the planned weights is measured globally
            (one fwd+bwd per candidate and direction, as in exact mode; with ``one_copy`` one per candidate with
            both directions lowered, see ``_plan_fast.measure_globally``): on SmolLM2 the lm_head's local drift
            (2.4% of logits, 8.7% of dX) hides a 54-57% drift of all dA/dB, as softmax amplifies logit errors.
        costs: the per-shape cost table (required for ``cost="measured"``, see ``lorad.kernels.costs.measure``).
        on_progress: called with the fraction of planning done (0..1) after each pass (fast mode).
        one_copy: every layer runs both directions at one precision, so it keeps ONE weight copy (a bf16 forward
            with an int8 input gradient would hold both a bf16 and an int8 copy: 3 bytes per weight instead of 2
            or 1). The measured cost table prices time only; this is the memory rule the product path plans with.

    Returns:
        The PrecisionPlan (the model is left with its original frozen linears and no gradients).

    Raises:
        ValueError: unknown cost model or mode, or a name in ``weights`` that is not a frozen linear of ``model``.
    """
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")
    if cost == "measured" and costs is None:
        raise ValueError("cost='measured' needs a cost table (costs=lorad.kernels.costs.measure(...))")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t_start = time.perf_counter()
    sites = frozen_sites(model, list(weights))
    was_training = model.training
    model.train(False)  # dropout off: the drift must come from precision only
    gen_state = torch.random.get_rng_state()  # planning must not shift the training RNG stream

    def build(name: str, pf: str, pb: str) -> Any:
        w, b = weights[name]
        return make_frozen_linear(w, b, backend=backend, precision=pf, precision_bwd=pb, name=name)

    try:
        run = _plan_fast if mode == "fast" else _plan_exact
        plan = run(model, loss_fn, sites, build, backend=backend, reference=reference, candidates=candidates,
                   budget=budget, max_layer_error=max_layer_error, cost=cost, calib_tokens=calib_tokens,
                   verify=verify, max_backoff=max_backoff, exact_share=exact_share, costs=costs,
                   on_progress=on_progress or (lambda _f: None), one_copy=one_copy)  # fmt: skip
    finally:
        for fl, s in sites.values():
            set_frozen(s, fl)
        model.train(was_training)
        for p in model.parameters():
            p.grad = None
        torch.random.set_rng_state(gen_state)
    plan.seconds = time.perf_counter() - t_start
    log.info("precision_plan_ready", **plan.summary())
    return plan


def _plan_exact(
    model: nn.Module, loss_fn: Callable[[], Tensor], sites: Mapping[str, tuple[Any, list[Site]]], build: Any,
    *, backend: str, reference: str, candidates: Sequence[str], budget: float, max_layer_error: float, cost: str,
    calib_tokens: int, verify: bool, max_backoff: int, exact_share: float, costs: CostTable | None,
    on_progress: Callable[[float], None], one_copy: bool,
) -> PrecisionPlan:  # fmt: skip
    del max_backoff, exact_share, on_progress
    if cost == "measured":
        raise ValueError("exact mode times layers itself: use cost='time' (or mode='fast' with cost='measured')")
    del costs
    ref_frozen = {n: build(n, reference, reference) for n in sites}
    for n, (_, s) in sites.items():
        set_frozen(s, ref_frozen[n])
    ref_a, ref_b, _ = _grads_run(model, loss_fn, None)
    plans: dict[str, LayerPlan] = {}
    for n, (fl0, s) in sites.items():
        probe = _probe_of(s)
        lp = LayerPlan(n, (fl0.out_features, fl0.in_features), reference, reference)
        _, _, ref_x = _grads_run(model, loss_fn, probe)
        for p in candidates:
            if p == reference:
                continue
            for direction in ("fwd", "bwd"):
                try:
                    fl = build(n, p, reference) if direction == "fwd" else build(n, reference, p)
                except ValueError:
                    continue  # backend lacks this precision
                set_frozen(s, fl)
                da, db, dx = _grads_run(model, loss_fn, probe)
                set_frozen(s, ref_frozen[n])
                (ca, ra), (cb, rb) = fast.drift(da, ref_a), fast.drift(db, ref_b)
                cx, rx = fast.drift(dx, ref_x)
                t_ms = float("nan")
                if cost == "time":
                    width = fl0.in_features if direction == "fwd" else fl0.out_features
                    op = fl.forward if direction == "fwd" else fl.input_grad
                    t_ms = _time_ms(op, _randn(calib_tokens, width))
                lp.measurements.append(Measurement(direction, p, ca, cb, cx, ra, rb, rx, t_ms))
        plans[n] = lp
        log.info("precision_layer_measured", layer=n, candidates=len(lp.measurements))
    ref_time: dict[str, float] = {}
    if cost == "time":
        for n, fl in ref_frozen.items():
            ref_time[f"{n}|fwd"] = _time_ms(fl.forward, _randn(calib_tokens, fl.in_features))
            ref_time[f"{n}|bwd"] = _time_ms(fl.input_grad, _randn(calib_tokens, fl.out_features))
    est = _choose(plans, reference=reference, budget=budget, max_layer_error=max_layer_error, cost=cost,
                  ref_time=ref_time, one_copy=one_copy)  # fmt: skip
    plan = PrecisionPlan(backend, reference, budget, cost, plans, est, mode="exact")
    if verify:
        for n, (_, s) in sites.items():
            set_frozen(s, build(n, *plan.precisions(n)))
        da, db, _ = _grads_run(model, loss_fn, None)
        plan.verified = fast.whole_drift(da, db, ref_a, ref_b)
    return plan


def _plan_fast(
    model: nn.Module, loss_fn: Callable[[], Tensor], sites: Mapping[str, tuple[Any, list[Site]]], build: Any,
    *, backend: str, reference: str, candidates: Sequence[str], budget: float, max_layer_error: float, cost: str,
    calib_tokens: int, verify: bool, max_backoff: int, exact_share: float, costs: CostTable | None,
    on_progress: Callable[[float], None], one_copy: bool,
) -> PrecisionPlan:  # fmt: skip
    del calib_tokens, verify  # fast mode times the captured rows and always verifies
    t0 = time.perf_counter()
    # The model's own frozen linears serve as the reference when they already are (building fp32 ORT sessions
    # costs ~54 ms per SmolLM2 layer, 11 s for the model).
    slots = {n: fast.Slot(fl if _is_reference(fl, backend, reference) else build(n, reference, reference))
             for n, (fl, _) in sites.items()}  # fmt: skip
    for n, (_, s) in sites.items():
        set_frozen(s, slots[n])
    # Dominant layers (by weight share) are measured globally below: no local drift, so nothing to record for them
    # unless their rows are timed (a 256x49152 dy of SmolLM2's lm_head is 50 MB).
    total_w = sum(sl.out_features * sl.in_features for sl in slots.values())
    dominant = {n for n, sl in slots.items() if sl.out_features * sl.in_features >= exact_share * total_w}
    for n, sl in slots.items():
        sl.recording = n not in dominant or cost == "time"
    t1 = time.perf_counter()
    ref_a, ref_b, _ = _grads_run(model, loss_fn, None, list(slots.values()))
    for sl in slots.values():
        sl.recording = False
    t2 = time.perf_counter()
    on_progress(0.3)
    impls: dict[tuple[str, str], Any] = {}
    plans: dict[str, LayerPlan] = {}
    ref_time: dict[str, float] = {}
    for i, (n, sl) in enumerate(slots.items()):
        on_progress(0.3 + 0.2 * i / max(len(slots), 1))
        plans[n] = fast.measure_locally(
            n, sl, reference=reference, candidates=candidates, build=build, cost=cost, costs=costs,
            ref_time=ref_time, impls=impls, drifts=n not in dominant,
        )  # fmt: skip
    log.info("precision_local_measured", layers=len(plans), candidates=len(impls))
    on_progress(0.5)

    def verify_run(choice: Mapping[str, tuple[str, str]]) -> dict[str, float]:
        fast.apply_choice(slots, impls, choice)
        da, db, _ = _grads_run(model, loss_fn, None)
        return fast.whole_drift(da, db, ref_a, ref_b)

    # Dominant layers: whole-model dA/dB drift instead of local measurements.
    per_run = 2 if one_copy else 1  # one-copy: one run per candidate measures both directions
    runs = sum(len(plans[n].measurements) for n in dominant) // per_run
    done = [0]

    def tick() -> None:
        on_progress(0.5 + 0.1 * done[0] / max(runs, 1))  # one whole fwd+bwd each: ~2 s at 135M params here
        done[0] += 1

    for n in dominant:
        fast.measure_globally(plans[n], plans, reference=reference, one_copy=one_copy, run=verify_run, tick=tick)
    k_box = [1.0]

    def sq(m: Measurement) -> float:
        # Global errors are already whole-plan drift: in Σe² units they count as (e/k)². A joint (one-copy, both
        # directions in one run) drift E is carried half by its fwd and half by its bwd entry: _choose, _more_accurate
        # and the back-off sum a layer's two entries, which then add up to the one measured E².
        e = m.error if m.local else m.error / max(k_box[0], 1e-12)
        return e * e * m.joint_share

    # Calibrate k: every locally measured (layer, direction) at its cheapest admissible candidate, in one run.
    cheapest: dict[str, tuple[str, str]] = {}
    sum_all = 0.0
    for n, lp in plans.items():
        if n in dominant:  # measured as whole-plan drift already: k calibrates the local Σe² only
            cheapest[n] = (reference, reference)
            continue
        pick = []
        picked: list[Measurement] = []
        for d in ("fwd", "bwd"):
            ok = [m for m in lp.measurements if m.direction == d and m.error <= max_layer_error]
            opts = [(_cost_of(lp, m, cost, ref_time), m.error, m, None) for m in ok]
            if cost != "bytes":  # the options _choose can pick: none inside the margin of a more accurate one
                opts = worth_their_cost([*opts, (ref_time.get(f"{n}|{d}", 0.0), 0.0, None, None)])
            best = min(((c, e, m) for c, e, m, _ in opts if m is not None), key=lambda t: (t[0], t[1]), default=None)
            pick.append(best[2].precision if best else reference)
            picked += [best[2]] if best else []
        if one_copy and not shares_copy(pick[0], pick[1]):
            both: list[tuple[Measurement, Measurement]] = []
            for p in sorted({pick[0], pick[1]} - {reference}):
                mf, mb = lp.measured("fwd", p), lp.measured("bwd", p)
                if mf is not None and mb is not None and max(mf.error, mb.error) <= max_layer_error:
                    both.append((mf, mb))  # admissible in both directions, as _choose requires
            costed = [(_cost_of(lp, mf, cost, ref_time) + _cost_of(lp, mb, cost, ref_time), mf.error + mb.error, mf, mb)
                      for mf, mb in both]  # fmt: skip
            if cost != "bytes":
                ref_ms = ref_time.get(f"{n}|fwd", 0.0) + ref_time.get(f"{n}|bwd", 0.0)
                costed = [t for t in worth_their_cost([*costed, (ref_ms, 0.0, None, None)]) if t[2] is not None]
            best2 = min(costed, key=lambda t: (t[0], t[1]), default=None)
            pick = [best2[2].precision] * 2 if best2 else [reference, reference]
            picked = [best2[2], best2[3]] if best2 else []
        sum_all += sum(sq(m) for m in picked)
        cheapest[n] = (pick[0], pick[1])
    t3 = time.perf_counter()
    on_progress(0.6)
    calib = verify_run(cheapest)
    t4 = time.perf_counter()
    on_progress(0.8)
    k = calib["error"] / math.sqrt(sum_all) if sum_all > 0 else 0.0
    k_box[0] = k if k > 0 else 1.0
    target_sq = (FIRST_AIM * budget / k) ** 2 if k > 0 else math.inf
    est_sq = _choose(plans, reference=reference, budget=target_sq, max_layer_error=max_layer_error, cost=cost,
                     ref_time=ref_time, err=sq, one_copy=one_copy)  # fmt: skip
    plan = PrecisionPlan(backend, reference, budget, cost, plans, k * math.sqrt(est_sq), mode="fast")
    plan.calibration = {"k": k, "cheapest_error": calib["error"], "cheapest_sum_sq": sum_all, "build_s": t1 - t0,
                        "global_layers": float(len(dominant)),
                        "reference_run_s": t2 - t1, "local_s": t3 - t2, "calibration_run_s": t4 - t3}  # fmt: skip
    choice = {n: plan.precisions(n) for n in plans}
    nothing = {"cos_da": 1.0, "rel_da": 0.0, "cos_db": 1.0, "rel_db": 0.0, "error": 0.0}
    verify_runs = 0
    if all(c == (reference, reference) for c in choice.values()):
        drift = nothing  # an all-reference plan is exact by definition
    elif choice == cheapest:
        # The calibration run measured this very plan (the same objects on the same batch, deterministic kernels):
        # its whole-model drift is this plan's verification, a second identical run would only repeat it (~2 s).
        drift = calib
    else:
        drift, verify_runs = verify_run(choice), 1
    for it in range(max_backoff + 1):
        dirs = ("fwd", "bwd")
        lowered = [(math.sqrt(sq(mm)), n, d) for n, lp in plans.items() for d, p in zip(dirs, choice[n], strict=True)
                   if p != reference and (mm := lp.measured(d, p)) is not None]  # fmt: skip
        plan.history.append({"iteration": float(it), "lowered": float(len(lowered)), **drift})
        if drift["error"] <= budget or not lowered:
            break
        if it == max_backoff:
            log.warning("precision_plan_fallback", error=drift["error"], budget=budget, lowered=len(lowered))
            choice = {n: (reference, reference) for n in plans}
            drift = nothing
            break
        now_sq = sum(e * e for e, _, _ in lowered)
        # Drift scales like sqrt(Σe²): aim Σe² at (budget/drift)² of now, with 20% margin.
        for n, d in fast.raise_worst(lowered, now_sq, now_sq * (budget / drift["error"]) ** 2 * 0.8):
            f, b = choice[n]
            if one_copy:
                # Step the layer (both directions, one copy) to its next more accurate option, e.g. w8a8 -> bf16
                # rather than straight back to fp32.
                choice[n] = _more_accurate(plans[n], (f, b), reference, max_layer_error, sq)
                continue
            f, b = (reference, b) if d == "fwd" else (f, reference)
            shape = plans[n].shape
            if cost == "bytes" and weight_bytes(shape, f, b) > weight_bytes(shape, reference, reference):
                f, b = reference, reference  # one direction low alone stores two copies: raise the layer whole
            choice[n] = (f, b)
        drift, verify_runs = verify_run(choice), verify_runs + 1
    for r in range(REFINE_ROUNDS):
        if not 0 < drift["error"] < REFINE_BELOW * budget:
            break
        on_progress(0.85 + 0.1 * r / REFINE_ROUNDS)
        runs_before = len(plan.history)
        choice, drift, refined = _refine(
            plans, choice, drift, budget=budget, reference=reference, max_layer_error=max_layer_error, cost=cost,
            ref_time=ref_time, sq=sq, k_box=k_box, one_copy=one_copy, verify_run=verify_run, history=plan.history,
        )  # fmt: skip
        verify_runs += len(plan.history) - runs_before  # the refinement's run, when it chose another plan
        if refined is None:
            break
        plan.estimated_error = refined
    for n, (pf, pb) in choice.items():
        plans[n].precision_fwd, plans[n].precision_bwd = pf, pb
    plan.verified = drift
    plan.calibration["verify_s"] = time.perf_counter() - t4
    plan.calibration["verify_runs"] = float(verify_runs)  # whole-model runs after the calibration run
    return plan


def _refine(
    plans: dict[str, LayerPlan], choice: dict[str, tuple[str, str]], drift: dict[str, float], *, budget: float,
    reference: str, max_layer_error: float, cost: str, ref_time: Mapping[str, float],
    sq: Callable[[Measurement], float], k_box: list[float], one_copy: bool,
    verify_run: Callable[[Mapping[str, tuple[str, str]]], dict[str, float]], history: list[dict[str, float]],
) -> tuple[dict[str, tuple[str, str]], dict[str, float], float | None]:  # fmt: skip
    """One ``REFINE_AIM`` choice (see there): (the plan kept, its verified drift, its estimated error or None when the
    plan before stands). Runs one whole-model verification when the choice differs from ``choice``."""
    dirs = ("fwd", "bwd")
    now_sq = sum(sq(m) for n, lp in plans.items() for d, p in zip(dirs, choice[n], strict=True)
                 if p != reference and (m := lp.measured(d, p)) is not None)  # fmt: skip
    if now_sq <= 0:
        return choice, drift, None
    k_first = k_box[0]
    k_box[0] = drift["error"] / math.sqrt(now_sq)
    aim_sq = (REFINE_AIM * budget / k_box[0]) ** 2
    est_sq = _choose(plans, reference=reference, budget=aim_sq, max_layer_error=max_layer_error, cost=cost,
                     ref_time=ref_time, err=sq, one_copy=one_copy)  # fmt: skip
    second = {n: (lp.precision_fwd, lp.precision_bwd) for n, lp in plans.items()}
    if second == choice:
        k_box[0] = k_first
        return choice, drift, None
    got = verify_run(second)
    lowered = sum(1 for c in second.values() for p in c if p != reference)
    history.append({"iteration": float(len(history)), "lowered": float(lowered), "refined": 1.0, **got})
    if got["error"] <= budget:
        return second, got, k_box[0] * math.sqrt(est_sq)
    k_box[0] = k_first
    return choice, drift, None


def _more_accurate(
    lp: LayerPlan, now: tuple[str, str], reference: str, max_layer_error: float, sq: Callable[[Measurement], float]
) -> tuple[str, str]:
    """The one-copy option of ``lp`` with the least error below that of ``now`` (the reference when none is)."""

    def err(p: str) -> float | None:
        ms = [lp.measured(d, p) for d in ("fwd", "bwd")]
        if any(m is None or not m.error <= max_layer_error for m in ms):
            return None
        return sum(sq(m) for m in ms if m is not None)

    cur = err(now[0]) if shares_copy(*now) and now[0] != reference else None
    opts = [(e, p) for p in {m.precision for m in lp.measurements} - {now[0]} if (e := err(p)) is not None]
    opts = [(e, p) for e, p in opts if cur is None or e < cur]
    return (min(opts)[1],) * 2 if opts else (reference, reference)


_BACKEND_CLASS = {"torch": "TorchFrozenLinear", "ort-cpu": "OrtCpuFrozenLinear", "qnn-htp": "QnnFrozenLinear"}


def _is_reference(fl: Any, backend: str, reference: str) -> bool:
    same_backend = type(fl).__name__ == _BACKEND_CLASS.get(backend)
    return same_backend and fl.precision_fwd == reference and fl.precision_bwd == reference


def _randn(t: int, width: int) -> Tensor:
    return torch.randn(t, width, generator=torch.Generator().manual_seed(0))


def _time_ms(fn: Callable[[Tensor], Tensor], a: Tensor, repeats: int = 3) -> float:
    fn(a)  # first call may build a bucket session
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(a)
    return (time.perf_counter() - t0) / repeats * 1e3


def _cost_of(lp: LayerPlan, m: Measurement, cost: str, ref_time: Mapping[str, float]) -> float:
    if cost in ("time", "measured"):
        return m.time_ms
    pf, pb = (m.precision, lp.precision_bwd) if m.direction == "fwd" else (lp.precision_fwd, m.precision)
    return float(weight_bytes(lp.shape, pf, pb))


def _per_weight_prices(
    options: dict[str, list[tuple[float, float, str, str]]], shapes: Mapping[str, tuple[int, int]]
) -> dict[str, list[tuple[float, float, str, str]]]:
    """Each option repriced at its layer's weight count times the median ms per weight of its precision pair.

    Which options a layer has stays decided by its own shape's measured times (``worth_their_cost``); what one layer's
    option saves against another's is then proportional to their weight counts. Choosing between two precisions, the
    knapsack ranks layers by weights per unit of error, whatever the table's numbers: the same model gets the same plan
    from any table that admits the same precisions per shape, where per-shape times (±10 % between fresh tables here)
    made two cold plans of one build take 14 and 32 int8 layers.
    """
    per_weight: dict[tuple[str, str], list[float]] = {}
    for n, opts in options.items():
        size = shapes[n][0] * shapes[n][1]
        for c, _, pf, pb in opts:
            per_weight.setdefault((pf, pb), []).append(c / size)
    price = {k: sorted(v)[len(v) // 2] for k, v in per_weight.items()}
    return {
        n: [(shapes[n][0] * shapes[n][1] * price[(pf, pb)], e, pf, pb) for _, e, pf, pb in opts]
        for n, opts in options.items()
    }


def _choose(
    plans: dict[str, LayerPlan],
    *,
    reference: str,
    budget: float,
    max_layer_error: float,
    cost: str,
    ref_time: Mapping[str, float],
    err: Callable[[Measurement], float] = lambda m: m.error,
    one_copy: bool = False,
) -> float:
    """Set each LayerPlan's precisions to the cheapest combination whose summed ``err`` is within ``budget``.

    Returns:
        The summed ``err`` of the chosen plan.
    """
    options: dict[str, list[tuple[float, float, str, str]]] = {}  # name -> [(cost, error, fwd, bwd)]
    for n, lp in plans.items():
        fwd = [(reference, 0.0, ref_time.get(f"{n}|fwd", 0.0), False)]
        bwd = [(reference, 0.0, ref_time.get(f"{n}|bwd", 0.0), False)]
        for m in lp.measurements:
            if m.error <= max_layer_error and not math.isnan(m.error):
                (fwd if m.direction == "fwd" else bwd).append((m.precision, err(m), m.time_ms, m.joint))
        opts = []
        for pf, ef, tf, jf in fwd:
            for pb, eb, tb, jb in bwd:
                if (one_copy and not shares_copy(pf, pb)) or ((jf or jb) and pf != pb):
                    continue  # a joint drift was measured with both directions at one precision: only that pair
                c = float(weight_bytes(lp.shape, pf, pb)) if cost == "bytes" else tf + tb
                opts.append((c, ef + eb, pf, pb))
        options[n] = opts if cost == "bytes" else worth_their_cost(opts)
    if cost == "measured":
        options = _per_weight_prices(options, {n: lp.shape for n, lp in plans.items()})

    def pick(lam: float) -> tuple[float, dict[str, tuple[float, float, str, str]]]:
        chosen = {n: min(o, key=lambda t: (t[0] + lam * t[1], t[1])) for n, o in options.items()}
        return sum(c[1] for c in chosen.values()), chosen

    # Larger λ buys accuracy; bisect (log scale) for the smallest λ whose plan fits the budget.
    lo, hi = 1e-12, 1e18
    total, best = pick(hi)
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        e, ch = pick(mid)
        if e <= budget:
            hi, total, best = mid, e, ch
        else:
            lo = mid
    # The sweep only reaches points on the convex hull: one layer with a huge saving and an error above what is
    # left (the 28 MB lm_head) can hide every small one. Fill the remaining budget greedily, best saving per error.
    while True:
        room = budget - total
        moves = [
            ((cur[0] - o[0]) / max(o[1] - cur[1], 1e-30), n, o)
            for n, cur in best.items()
            for o in options[n]
            if o[0] < cur[0] and o[1] - cur[1] <= room
        ]
        if not moves:
            break
        _, n, o = max(moves, key=lambda t: t[0])
        total += o[1] - best[n][1]
        best[n] = o
    for n, (_, _, pf, pb) in best.items():
        plans[n].precision_fwd, plans[n].precision_bwd = pf, pb
    return total
