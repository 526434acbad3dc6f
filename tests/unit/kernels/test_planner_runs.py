"""Which whole-model runs the fast planner makes: dominant layers (one per candidate in one-copy plans), verify."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lorad.kernels import apply_plan, plan_precision, planner
from lorad.kernels.plan import shares_copy
from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.config import LoraConfig
from lorad.server.engine.training.precision import _seeded_adapter, calibration_loss
from tests.fixtures.tiny_lm import CharTokenizer
from tests.unit.kernels.test_planner import _chain_setup, _setup
from tests.unit.training.test_train_recipe import MCFG, _weights


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, tuple[str, str]]]:
    """Every whole-model run after the reference one, as the layer -> (fwd, bwd) choice it ran with, in order."""
    seen: list[dict[str, tuple[str, str]]] = []
    real = planner.fast.apply_choice

    def spy(slots: Any, impls: Any, choice: Any) -> None:
        seen.append(dict(choice))
        real(slots, impls, choice)

    monkeypatch.setattr(planner.fast, "apply_choice", spy)
    return seen


@pytest.mark.parametrize("one_copy", [True, False])
def test_dominant_layer_runs_once_per_candidate_in_one_copy_plans(
    runs: list[Any], one_copy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, loss_fn, weights = _setup()  # hard: 60% of the weights, easy: 40% (lossless in int8)
    local: list[tuple[int, int]] = []
    real_products = planner.fast.reference_products

    def spy(slot: Any, *a: Any) -> Any:
        local.append((slot.out_features, slot.in_features))
        return real_products(slot, *a)

    monkeypatch.setattr(planner.fast, "reference_products", spy)
    plan = plan_precision(model, loss_fn, weights, candidates=("w8a16", "w8a8"), budget=0.05, exact_share=0.5,
                          one_copy=one_copy)  # fmt: skip
    assert plan.calibration["global_layers"] == 1.0
    assert local == [(24, 16)]  # easy only: nothing reads a dominant layer's local drift: its products are not computed
    # Global runs come first (every other layer at the reference), then the calibration, then the verify rounds.
    glob = [c["hard"] for c in runs if c["easy"] == ("fp32", "fp32") and c["hard"] != ("fp32", "fp32")]
    if one_copy:
        assert glob == [("w8a16", "w8a16"), ("w8a8", "w8a8")]
    else:
        assert glob == [("w8a16", "fp32"), ("fp32", "w8a16"), ("w8a8", "fp32"), ("fp32", "w8a8")]
    assert runs[: len(glob)] == [{"easy": ("fp32", "fp32"), "hard": h} for h in glob]
    assert len(runs) == len(glob) + 1 + plan.calibration["verify_runs"], plan.table()
    hard = plan.layers["hard"]
    assert len(hard.measurements) == 4 and not any(m.local for m in hard.measurements)
    for p in ("w8a16", "w8a8"):
        f, b = hard.measured("fwd", p), hard.measured("bwd", p)
        assert f is not None and b is not None and f.joint == b.joint == one_copy
        if one_copy:  # one run behind both entries: the same whole-model drift, counted once in Σe²
            assert (f.rel_da, f.rel_db) == (b.rel_da, b.rel_db) and f.error > 0.1
            assert f.joint_share + b.joint_share == 1.0
    assert plan.precisions("hard") == ("fp32", "fp32")  # int8 wrecks it either way
    assert plan.layers["easy"].precision_fwd in ("w8a16", "w8a8")
    assert plan.verified["error"] <= 0.05


def test_joint_pairs_are_offered_only_as_measured() -> None:
    """A joint drift was measured with both directions at one precision: w8a16 fwd + w8a8 bwd (one int8 copy) is not."""
    from lorad.kernels.plan import LayerPlan, Measurement
    from lorad.kernels.planner import _choose

    nan = float("nan")

    def joint(d: str, p: str, e: float, t: float) -> Measurement:
        return Measurement(d, p, nan, nan, nan, e, e, nan, t, local=False, joint=True)

    # w8a16 forward and w8a8 backward are the cheap directions; the mixed pair would win if it were offered.
    ms = [joint("fwd", "w8a16", 0.01, 1.0), joint("bwd", "w8a16", 0.01, 5.0)]
    ms += [joint("fwd", "w8a8", 0.01, 5.0), joint("bwd", "w8a8", 0.01, 1.0)]
    plans = {"head": LayerPlan("head", (64, 32), "fp32", "fp32", ms)}
    _choose(plans, reference="fp32", budget=1.0, max_layer_error=0.1, cost="measured",
            ref_time={"head|fwd": 9.0, "head|bwd": 9.0}, one_copy=True)  # fmt: skip
    assert plans["head"].precision_fwd == plans["head"].precision_bwd != "fp32"


def _grads(model: torch.nn.Module, loss_fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    loss_fn().backward()
    return planner._flat_grads(model, "lora_A").clone(), planner._flat_grads(model, "lora_B").clone()


def test_one_copy_plan_of_the_tiny_llama_stays_within_budget(runs: list[Any]) -> None:
    """The lorad CausalLM with its tied lm_head measured globally: one run per candidate, and the plan's drift,
    re-measured on the re-lowered model, within the budget."""
    torch.manual_seed(0)
    model = build_model(MCFG, _weights(), backend="torch", precision="fp32", lora=LoraConfig(4, 8.0, dropout=0.0))
    _seeded_adapter(model)
    w = _weights()
    weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
        k.removesuffix(".weight"): (t, None) for k, t in w.items() if k.startswith("model.layers.") and t.dim() == 2
    }
    weights["lm_head"] = (w["model.embed_tokens.weight"], None)  # tied, 64x32: 12% of the planned weights
    loss_fn = calibration_loss(model, CharTokenizer(), 48)
    ref_a, ref_b = _grads(model, loss_fn)
    budget = 0.05
    plan = plan_precision(model, loss_fn, weights, candidates=("bf16", "w8a8"), budget=budget, exact_share=0.1,
                          one_copy=True)  # fmt: skip
    assert plan.calibration["global_layers"] == 1.0
    head = plan.layers["lm_head"]
    assert {(m.direction, m.precision) for m in head.measurements} == {
        (d, p) for d in ("fwd", "bwd") for p in ("bf16", "w8a8")
    }
    assert all(m.joint and not m.local for m in head.measurements)
    alone = [c["lm_head"] for c in runs if all(v == ("fp32", "fp32") for n, v in c.items() if n != "lm_head")]
    assert alone[:2] == [("bf16", "bf16"), ("w8a8", "w8a8")], plan.table()
    assert all(shares_copy(*plan.precisions(n)) for n in weights)
    assert plan.weight_bytes() < 4 * sum(t.numel() for t, _ in weights.values()), plan.table()  # something lowered
    assert plan.verified["error"] <= budget, plan.table()
    apply_plan(model, plan, weights, backend="torch")
    got = planner.fast.whole_drift(*_grads(model, loss_fn), ref_a, ref_b)
    assert got["error"] <= budget and got["error"] == pytest.approx(plan.verified["error"], abs=1e-4), plan.table()


def test_a_plan_equal_to_the_calibration_plan_is_verified_by_that_run(runs: list[Any]) -> None:
    """easy goes to int8 in both the calibration and the chosen plan, hard stays fp32 in both: one run measures it,
    and its drift is the plan's, as a fresh run of the re-lowered model confirms."""
    model, loss_fn, weights = _setup()
    ref_a, ref_b = _grads(model, loss_fn)
    # w8a16 is lossless on easy's grid; on hard its forward error (> max_layer_error) rules it out for both
    # directions of its one copy, in the calibration as in the plan.
    plan = plan_precision(model, loss_fn, weights, candidates=("w8a16",), budget=0.05, exact_share=1, one_copy=True)
    assert plan.precisions("easy") == ("w8a16", "w8a16") and plan.precisions("hard") == ("fp32", "fp32")
    assert runs == [{"easy": ("w8a16", "w8a16"), "hard": ("fp32", "fp32")}]  # the calibration run, nothing after
    assert plan.calibration["verify_runs"] == 0.0 and plan.verified["error"] == plan.calibration["cheapest_error"]
    apply_plan(model, plan, weights, backend="torch")
    assert planner.fast.whole_drift(*_grads(model, loss_fn), ref_a, ref_b) == plan.verified


def test_a_plan_other_than_the_calibration_plan_gets_its_own_run(runs: list[Any]) -> None:
    model, loss_fn, weights = _chain_setup()
    # Below what lowering every layer measures: the plan lowers only some, so the calibration run did not measure it.
    all_low = plan_precision(model, loss_fn, weights, candidates=("w8a8",), budget=1.0, max_layer_error=1.0)
    runs.clear()
    budget = all_low.calibration["cheapest_error"] / 2
    plan = plan_precision(model, loss_fn, weights, candidates=("w8a8",), budget=budget, max_layer_error=1.0)
    calibration, verified = runs[0], runs[1:]
    assert all(c == ("w8a8", "w8a8") for c in calibration.values())
    assert len(verified) == plan.calibration["verify_runs"] == len(plan.history) >= 1, plan.table()
    assert verified[0] != calibration and plan.verified["error"] <= budget


def test_local_measurements_reuse_the_reference_runs_products() -> None:
    from types import SimpleNamespace

    from lorad.kernels import make_frozen_linear
    from lorad.kernels._plan_fast import Slot, reference_products

    g = torch.Generator().manual_seed(0)
    fl = make_frozen_linear(torch.randn(24, 16, generator=g), torch.randn(24, generator=g), backend="torch")
    slot = Slot(fl)
    slot.recording = True
    xs, dys = [torch.randn(8, 16, generator=g) for _ in range(2)], [torch.randn(8, 24, generator=g) for _ in range(2)]
    for x, dy in zip(xs, dys, strict=True):  # two calls, as a layer run twice per step
        slot.forward(x).add_(1.0)  # the LoRA ops add their terms in place: the recorded copies must not move
        slot.input_grad(dy).add_(1.0)
    x, dy = slot.captured()

    def no_recompute(_t: torch.Tensor) -> torch.Tensor:
        raise AssertionError("reference product computed again")

    slot.ref = SimpleNamespace(forward=no_recompute, input_grad=no_recompute)
    y, dx = reference_products(slot, x, dy)
    torch.testing.assert_close(y, fl.forward(torch.cat(xs)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, fl.input_grad(torch.cat(dys)), rtol=1e-6, atol=1e-6)
