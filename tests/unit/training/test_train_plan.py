"""Precision "auto" in the recipe (tiny random Llama on ort-cpu): plan once, persist, reuse the same plan on resume."""

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from lorad import kernels
from lorad.kernels import PrecisionPlan, costs
from lorad.kernels.capabilities import capability
from lorad.kernels.plan_cache import cache_path
from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.config import LEGACY_TARGETS
from lorad.server.engine.training import recipe
from lorad.server.engine.training.checkpoint import CheckpointError
from lorad.server.engine.training.config import ConfigError, TrainConfig
from lorad.server.engine.training.precision import PLAN_CACHE, PLAN_FILE, UNPLANNED_FILE, plan_cache_key, provisional
from tests.fixtures.tiny_lm import CharTokenizer
from tests.unit.training.test_train_recipe import CFG, MCFG, SAMPLES, _weights

AUTO = replace(CFG, backend="ort-cpu", precision="auto", steps=4, eval_every=2, dropout=0.0)


def hf_load(source: Any, *, cache_root: Path, backend: str, precision: Any, lora: Any) -> SimpleNamespace:
    """The tiny model as the real loader returns it: built from an HF-style folder that `checkpoint.path` names."""
    folder = cache_root / "tiny_hf"
    if not folder.is_dir():
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in _weights().items()}, str(folder / "model.safetensors"))
    model = build_model(MCFG, _weights(), backend=backend, precision=precision, lora=lora)
    return SimpleNamespace(model=model, tokenizer=CharTokenizer(), config=MCFG, model_hash="tiny",
                           tokenizer_hash="char", checkpoint=SimpleNamespace(path=folder))  # fmt: skip


def _run(work: Path, cache: Path, cfg: TrainConfig = AUTO, **kw: Any) -> Any:
    return recipe.run_recipe(cfg, SAMPLES, work_dir=work, cache_root=cache, load=hf_load, **kw)


@pytest.fixture
def plan_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts planner runs, and prices w8a8 at half of fp32 so the tiny layers get lowered.

    The cost table is measured for real (the planner drops any precision that is not faster); on 32-wide toy layers
    ORT's int8 path is not faster than fp32, so without this the plan would be all fp32 and these tests, which are
    about persisting and re-applying a plan, would not see a lowered layer. The table counts as timed on a quiet host
    (CPU share 1.0) whatever else runs on the test machine: under load a real share below ``costs.BUSY_SHARE`` made the
    plan provisional and the next job measure again (seen with a benchmark running beside the suite); the busy case
    has its own tests (``_first_table_busy``).
    """
    calls: list[int] = []
    real = kernels.plan_precision
    real_measure = costs.measure

    def spy(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    def cheap_w8a8(*a: Any, **k: Any) -> costs.CostTable:
        t = real_measure(*a, **k)
        for key in [k2 for k2 in t.ms if "|w8a8|" in k2]:
            t.ms[key] = 0.5 * t.ms[key.replace("|w8a8|", "|fp32|")]
        t.cpu_share = 1.0
        return t

    monkeypatch.setattr(kernels, "plan_precision", spy)
    monkeypatch.setattr(costs, "measure", cheap_w8a8)
    return calls


def test_auto_on_ort_cpu_plans_per_layer_and_persists(tmp_path: Path, plan_calls: list[int]) -> None:
    rng: list[torch.Tensor] = []
    real_plan_job = recipe.plan_job

    def spy(*a: Any, **k: Any) -> Any:
        rng.append(torch.random.get_rng_state())
        out = real_plan_job(*a, **k)
        rng.append(torch.random.get_rng_state())
        return out

    recipe.plan_job = spy  # type: ignore[assignment]
    try:
        r = _run(tmp_path / "job", tmp_path / "cache")
    finally:
        recipe.plan_job = real_plan_job  # type: ignore[assignment]
    assert r.status == "completed" and r.precision == "auto" and plan_calls == [1]
    assert torch.equal(rng[0], rng[1]), "planning moved the training RNG stream"
    blob = (tmp_path / "job" / PLAN_FILE).read_bytes()
    plan = PrecisionPlan.from_dict(json.loads(blob))
    assert r.plan_sha256 == hashlib.sha256(blob).hexdigest()
    names = {n for n, _, _ in r.precision_plan}
    assert len(names) == 2 * 7 + 1 and "lm_head" in names and "model.layers.1.mlp.down_proj" in names
    assert all(f in ("fp32", "w8a8") and b in ("fp32", "w8a8") for _, f, b in r.precision_plan)
    assert r.precision_plan == tuple((n, *plan.precisions(n)) for n, _, _ in r.precision_plan)
    assert r.plan_summary is not None and r.plan_summary["layers"] == 15 and r.plan_summary["mode"] == "fast"
    meta = json.loads((r.adapter_dir / "training_metadata.json").read_text())
    assert meta["precision"] == "auto" and meta["precision_plan"]["sha256"] == r.plan_sha256
    assert [tuple(x) for x in meta["precision_plan"]["layers"]] == list(r.precision_plan)


def test_resume_reuses_the_persisted_plan_without_planning(tmp_path: Path, plan_calls: list[int]) -> None:
    cache = tmp_path / "cache"
    ref = _run(tmp_path / "straight", cache)
    assert plan_calls == [1]
    # Layers are lowered, so a resume that forgot to apply the plan would train at fp32 and change the losses.
    assert sum(f == "w8a8" for _, f, _ in ref.precision_plan) >= 8
    n: list[int] = []
    p = _run(tmp_path / "job", cache, on_progress=lambda pr: n.append(pr.step), should_pause=lambda: len(n) >= 2)
    assert p.status == "paused" and p.step == 2 and plan_calls == [1]  # same key: the plan cache served it
    plan_file = tmp_path / "job" / PLAN_FILE
    before = plan_file.read_bytes()
    # A resume must not even consult the cache: drop it, and fail loudly should anything try to plan.
    for f in (cache / "plans").glob("*.json"):
        f.unlink()
    r = _run(tmp_path / "job", cache)
    assert r.status == "completed" and r.resumed_from == 2 and plan_calls == [1]
    assert plan_file.read_bytes() == before and not list((cache / "plans").glob("*.json"))
    assert r.plan_sha256 == p.plan_sha256 == ref.plan_sha256 and r.precision_plan == ref.precision_plan
    assert r.losses == ref.losses and r.eval_losses == ref.eval_losses


def test_resume_without_plan_file_fails_clearly(tmp_path: Path, plan_calls: list[int]) -> None:
    n: list[int] = []
    _run(
        tmp_path / "job", tmp_path / "cache", on_progress=lambda pr: n.append(pr.step), should_pause=lambda: len(n) >= 1
    )
    (tmp_path / "job" / PLAN_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"precision_plan\.json is missing"):
        _run(tmp_path / "job", tmp_path / "cache")
    assert plan_calls == [1]


def test_torch_auto_plans_bf16_where_native_and_explicit_precision_is_one_layout(tmp_path: Path) -> None:
    r = _run(tmp_path / "t", tmp_path / "cache", replace(AUTO, backend="torch", steps=2))
    menu = capability("torch").planner_menu()
    if menu:  # bf16 / w8a8 native here: on the menu, the measured cost decides per layer
        assert r.precision == "auto" and (tmp_path / "t" / PLAN_FILE).exists()
        # One stored copy per layer: both directions at one precision.
        assert all(f == b and f in ("fp32", *menu) for _, f, b in r.precision_plan), r.precision_plan
        plan = PrecisionPlan.from_dict(json.loads((tmp_path / "t" / PLAN_FILE).read_text()))
        assert plan.cost_model == "measured" and all(any(f"|{p}|" in k for k in plan.costs) for p in menu)
    else:  # nothing real to choose: torch stays at its fp32 reference, no planning
        assert r.precision == "fp32" and r.precision_plan == (("*", "fp32", "fp32"),) and r.plan_sha256 is None
        assert not (tmp_path / "t" / PLAN_FILE).exists()
    r = _run(tmp_path / "o", tmp_path / "cache", replace(AUTO, precision="w8a8", steps=2))
    assert r.precision_plan == (("*", "w8a8", "w8a8"),) and not (tmp_path / "o" / PLAN_FILE).exists()


@pytest.mark.parametrize("budget", [0, -0.1, 1.5, "x"])
def test_precision_budget_is_validated(budget: Any) -> None:
    with pytest.raises(ConfigError, match="precision_budget"):
        TrainConfig(precision_budget=budget)


def test_a_plan_cached_under_the_short_name_key_is_reused_and_restored(tmp_path: Path, plan_calls: list[int]) -> None:
    cache = tmp_path / "cache"
    ref = _run(tmp_path / "first", cache)
    assert plan_calls == [1]
    new_key, old_key = plan_cache_key("tiny", "ort-cpu", AUTO), plan_cache_key("tiny", "ort-cpu", AUTO, legacy=True)
    assert old_key["extra"]["targets"] == sorted(LEGACY_TARGETS) and new_key != old_key
    new_path, old_path = cache_path(cache / PLAN_CACHE, new_key), cache_path(cache / PLAN_CACHE, old_key)
    doc = json.loads(new_path.read_text())
    new_path.unlink()
    old_path.write_text(json.dumps({"key": old_key, "plan": doc["plan"]}))  # what an older lorad left in the cache
    r = _run(tmp_path / "second", cache)
    assert plan_calls == [1], "the legacy entry served the plan: no planning"
    assert r.precision_plan == ref.precision_plan and new_path.is_file()


def test_planning_reports_at_least_every_second_even_when_one_pass_is_slow(
    tmp_path: Path, plan_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import itertools
    import time

    real = kernels.plan_precision

    def slow(*a: Any, **k: Any) -> Any:
        time.sleep(2.6)  # one pass of a busy phone: no progress callback from the planner meanwhile
        return real(*a, **k)

    monkeypatch.setattr(kernels, "plan_precision", slow)
    seen: list[tuple[float, float | None]] = []
    _run(
        tmp_path / "job",
        tmp_path / "cache",
        on_phase=lambda p, f: p == "planning" and seen.append((time.monotonic(), f)),
    )
    times = [t for t, _ in seen]
    assert len(times) >= 4 and seen[-1][1] == 1.0  # 0.0, >= 2 heartbeats during the sleep, ..., 1.0
    assert max(b - a for a, b in itertools.pairwise(times)) < 2.0  # the product promise: an event per 2 s


def _first_table_busy(monkeypatch: pytest.MonkeyPatch, later_share: float) -> list[str]:
    """The first cost table is timed busy (CPU share 0.3), the second one quiet; the quiet probe says ``later_share``.

    Returns:
        The backends the probe was asked about, in order.
    """
    cheap = costs.measure  # the fixture's w8a8-at-half-price table
    shares = [0.3, 1.0]
    probes: list[str] = []

    def timed(*a: Any, **k: Any) -> costs.CostTable:
        t = cheap(*a, **k)
        t.cpu_share = shares.pop(0)
        return t

    def probe(backend: str, seconds: float = 0.2) -> float:
        probes.append(backend)
        return later_share

    monkeypatch.setattr(costs, "measure", timed)
    monkeypatch.setattr(costs, "cpu_share_now", probe)
    return probes


@pytest.mark.parametrize("later_share", [0.3, 1.0], ids=["host-still-busy", "host-quiet-again"])
def test_a_plan_priced_on_a_busy_host_is_provisional(
    tmp_path: Path, plan_calls: list[int], monkeypatch: pytest.MonkeyPatch, later_share: float
) -> None:
    """Reused at once while the host stays busy (no job waits for planning again); re-planned by the first job that
    starts on a quiet host, whose plan then stays."""
    probes = _first_table_busy(monkeypatch, later_share)
    cache = tmp_path / "cache"
    first = _run(tmp_path / "a", cache)
    assert first.status == "completed" and any(f == "w8a8" for _, f, _ in first.precision_plan)  # the plan was used
    plan = PrecisionPlan.from_dict(json.loads((tmp_path / "a" / PLAN_FILE).read_text()))
    assert plan.calibration["costs_cpu_share"] == pytest.approx(0.3)  # stored with the job, and in the cache
    assert provisional(plan) and len(list((cache / PLAN_CACHE).glob("plan-*.json"))) == 1
    assert _run(tmp_path / "b", cache).status == "completed" and probes == ["ort-cpu"]
    if later_share < costs.BUSY_SHARE:
        assert plan_calls == [1]  # still busy: the provisional plan served the second job
        return
    assert plan_calls == [1, 1]  # quiet: the second job planned, and its plan replaced the provisional one
    again = PrecisionPlan.from_dict(json.loads((tmp_path / "b" / PLAN_FILE).read_text()))
    assert not provisional(again)
    assert _run(tmp_path / "c", cache).status == "completed" and plan_calls == [1, 1] and probes == ["ort-cpu"]


@pytest.mark.parametrize("later_share", [0.3, 1.0], ids=["host-still-busy", "host-quiet-again"])
def test_a_deferred_job_trains_on_a_provisional_plan_and_remeasures_it_last_on_a_quiet_host(
    tmp_path: Path, plan_calls: list[int], monkeypatch: pytest.MonkeyPatch, later_share: float
) -> None:
    probes = _first_table_busy(monkeypatch, later_share)
    cache = tmp_path / "cache"
    first = _run(tmp_path / "a", cache, defer_planning=True)  # cold: trains unplanned, caches a provisional plan
    assert first.extra["planned_after"] and plan_calls == [1] and probes == []
    (cached,) = _plans(cache)
    assert provisional(PrecisionPlan.from_dict(json.loads(cached.read_text())["plan"]))
    phases: list[str] = []
    second = _run(tmp_path / "b", cache, defer_planning=True, on_phase=lambda p, f: phases.append(p))
    # It trained on the provisional plan (lowered layers and all), never unplanned, and asked the host only at its end.
    assert second.precision == "auto" and "unplanned" not in second.extra and probes == ["ort-cpu"]
    assert any(f == "w8a8" for _, f, _ in second.precision_plan)
    assert "planning" not in phases[: phases.index("exporting")]
    if later_share < costs.BUSY_SHARE:  # still busy: the provisional plan stays, nothing re-measured
        assert second.extra == {"planned_after": True} and plan_calls == [1] and "planning" not in phases
        return
    assert second.extra == {"planned_after": True} and plan_calls == [1, 1] and phases[-1] == "planning"
    (cached,) = _plans(cache)
    assert not provisional(PrecisionPlan.from_dict(json.loads(cached.read_text())["plan"]))
    third = _run(tmp_path / "c", cache, defer_planning=True)  # the quiet plan stays: nothing measured after
    assert third.extra == {} and plan_calls == [1, 1] and probes == ["ort-cpu"]


def _plans(cache: Path) -> list[Path]:
    return sorted((cache / PLAN_CACHE).glob("plan-*.json"))


def test_a_deferred_cold_job_trains_at_once_and_measures_the_plan_after_its_adapter(
    tmp_path: Path, plan_calls: list[int]
) -> None:
    """The daemon's way (``defer_planning``): no waiting for planning before the first step; the plan is measured as
    the job's last phase, after the adapter is saved, and the next job of the same shape trains on it."""
    cache, phases, notes = tmp_path / "cache", [], []
    unplanned = capability("ort-cpu").unplanned()
    r = _run(tmp_path / "a", cache, defer_planning=True, on_notice=notes.append,
             on_phase=lambda p, f: phases.append(p))  # fmt: skip
    assert r.status == "completed" and r.precision == unplanned and r.precision_plan == (("*", unplanned, unplanned),)
    assert r.extra == {"unplanned": unplanned, "planned_after": True} and plan_calls == [1] and len(_plans(cache)) == 1
    order = list(dict.fromkeys(phases))
    assert order.index("training") < order.index("exporting") < order.index("planning"), order
    assert "no precision plan for this model yet" in notes[0]
    meta = json.loads((r.adapter_dir / "training_metadata.json").read_text())
    assert meta["precision"] == unplanned and "precision_plan" not in meta
    phases.clear()
    r2 = _run(tmp_path / "b", cache, defer_planning=True, on_phase=lambda p, f: phases.append(p))
    assert r2.precision == "auto" and r2.extra == {} and plan_calls == [1] and "planning" not in phases
    assert any(f == "w8a8" for _, f, _ in r2.precision_plan)  # the measured plan, lowered layers and all


def test_a_deferred_job_resumes_at_the_precision_it_started_with_once_the_plan_exists(
    tmp_path: Path, plan_calls: list[int]
) -> None:
    cache = tmp_path / "cache"
    straight = _run(tmp_path / "straight", tmp_path / "other-cache", defer_planning=True)
    n: list[int] = []
    p = _run(tmp_path / "job", cache, defer_planning=True, on_progress=lambda pr: n.append(pr.step),
             should_pause=lambda: len(n) >= 2)  # fmt: skip
    assert p.status == "paused" and p.extra == {"unplanned": straight.precision} and len(_plans(cache)) == 0
    assert _run(tmp_path / "other", cache, defer_planning=True).extra["planned_after"] and len(_plans(cache)) == 1
    notes: list[str] = []
    r = _run(tmp_path / "job", cache, defer_planning=True, on_notice=notes.append)
    assert r.status == "completed" and r.resumed_from == 2 and r.precision == straight.precision
    assert r.losses == straight.losses and r.eval_losses == straight.eval_losses  # not switched to the plan mid-job
    assert "resumes at" in notes[0] and r.extra == {"unplanned": straight.precision, "planned_after": True}


def test_a_stop_while_planning_after_training_keeps_the_adapter_and_caches_nothing(
    tmp_path: Path, plan_calls: list[int]
) -> None:
    phases: list[str] = []
    notes: list[str] = []
    r = _run(tmp_path / "a", tmp_path / "cache", defer_planning=True, on_notice=notes.append,
             on_phase=lambda p, f: phases.append(p), should_pause=lambda: "planning" in phases)  # fmt: skip
    assert r.status == "completed" and (r.adapter_dir / "adapter_model.safetensors").is_file()
    assert r.extra["planned_after"] is False and not _plans(tmp_path / "cache")
    assert "planning stopped" in notes[-1]
    again = _run(tmp_path / "b", tmp_path / "cache", defer_planning=True)  # the next unplanned job measures it
    assert again.extra["planned_after"] is True and len(_plans(tmp_path / "cache")) == 1


def test_a_failure_while_planning_after_training_is_told_and_the_job_still_succeeds(
    tmp_path: Path, plan_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("planner exploded on layer 3")

    monkeypatch.setattr(recipe, "measure_plan", broken)
    notes: list[str] = []
    r = _run(tmp_path / "a", tmp_path / "cache", defer_planning=True, on_notice=notes.append)
    assert r.status == "completed" and r.adapter_dir is not None and r.extra["planned_after"] is False
    assert "planner exploded on layer 3" in notes[-1] and not _plans(tmp_path / "cache")


def test_a_deferred_job_resumed_on_another_backend_or_with_a_torn_record_fails_clearly(
    tmp_path: Path, plan_calls: list[int]
) -> None:
    n: list[int] = []
    p = _run(tmp_path / "job", tmp_path / "cache", defer_planning=True, on_progress=lambda pr: n.append(pr.step),
             should_pause=lambda: len(n) >= 1)  # fmt: skip
    assert p.status == "paused" and p.extra == {"unplanned": capability("ort-cpu").unplanned()}
    record = tmp_path / "job" / UNPLANNED_FILE
    kept = record.read_bytes()
    with pytest.raises(CheckpointError, match=r"on backend 'ort-cpu', this run uses 'torch'; resume on 'ort-cpu'"):
        _run(tmp_path / "job", tmp_path / "cache", replace(AUTO, backend="torch"), defer_planning=True)
    record.write_bytes(b'{"precision": "bf16"')
    with pytest.raises(CheckpointError, match=r"precision_unplanned\.json: unreadable"):
        _run(tmp_path / "job", tmp_path / "cache", defer_planning=True)
    assert plan_calls == [] and (tmp_path / "job" / "checkpoints").is_dir()  # nothing planned, the checkpoint kept
    record.write_bytes(kept)
    assert _run(tmp_path / "job", tmp_path / "cache", defer_planning=True).resumed_from == 1


def test_an_auto_job_resumes_on_its_plan_where_auto_would_not_plan_and_not_on_another_backend(
    tmp_path: Path, plan_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _run(tmp_path / "straight", tmp_path / "cache")
    n: list[int] = []
    p = _run(tmp_path / "job", tmp_path / "cache", on_progress=lambda pr: n.append(pr.step),
             should_pause=lambda: len(n) >= 2)  # fmt: skip
    assert p.status == "paused" and plan_calls == [1] and any(f == "w8a8" for _, f, _ in ref.precision_plan)
    # The same job directory where "auto" plans nothing (a CPU whose every reduced precision is emulated).
    monkeypatch.setattr(recipe, "plans_here", lambda *_a: False)
    with pytest.raises(CheckpointError, match=r"plan was made for backend 'ort-cpu', this run uses 'torch'"):
        _run(tmp_path / "job", tmp_path / "cache", replace(AUTO, backend="torch"))
    r = _run(tmp_path / "job", tmp_path / "cache")
    assert r.status == "completed" and r.resumed_from == 2 and plan_calls == [1]
    assert r.precision_plan == ref.precision_plan and r.losses == ref.losses  # exact: the plan it started on
