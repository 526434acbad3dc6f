"""Plan cache: hit on the same key, miss on another, corrupt file ignored with a reason and replanned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from lorad.kernels.plan_cache import cache_path, load_or_plan, plan_key
from tests.unit.kernels.test_planner import _setup


def _plan(tmp_path: Path, **kw: object):
    model, loss_fn, weights = _setup()
    calls = {"n": 0}

    def counting() -> object:
        calls["n"] += 1
        return loss_fn()

    args = {"model_hash": "abc", "backend": "torch", "candidates": ("w8a8", "fp16"), "budget": 0.05, **kw}
    plan, hit = load_or_plan(tmp_path, model, counting, weights, **args)  # type: ignore[arg-type]
    return plan, hit, calls["n"]


def test_second_call_loads_the_same_plan_without_running_the_model(tmp_path: Path) -> None:
    first, hit1, n1 = _plan(tmp_path)
    second, hit2, n2 = _plan(tmp_path, candidates=("fp16", "w8a8"))  # order does not matter
    assert (hit1, hit2) == (False, True)
    assert n1 > 0 and n2 == 0
    assert second.to_dict() == first.to_dict()
    assert len(list(tmp_path.glob("plan-*.json"))) == 1
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write left no temp file


@pytest.mark.parametrize("change", [{"budget": 0.01}, {"model_hash": "other"}, {"extra_key": {"rank": 4}}])
def test_another_key_replans(tmp_path: Path, change: dict[str, object]) -> None:
    _plan(tmp_path)
    _, hit, n = _plan(tmp_path, **change)
    assert not hit and n > 0
    assert len(list(tmp_path.glob("plan-*.json"))) == 2


def test_key_includes_planner_version_and_layers() -> None:
    k = plan_key(model_hash="a", backend="torch", candidates=("w8a8",), budget=0.05, layers={"q": (2, 3)})
    assert k["planner_version"]
    assert k["layers"] != plan_key(model_hash="a", backend="torch", candidates=("w8a8",), budget=0.05)["layers"]


@pytest.mark.parametrize("garbage", ["{not json", '{"key": 1}', "CORRUPT_PLAN"])
def test_corrupt_cache_file_is_ignored_with_a_reason_and_replanned(tmp_path: Path, garbage: str) -> None:
    first, _, _ = _plan(tmp_path)
    (path,) = tmp_path.glob("plan-*.json")
    if garbage == "CORRUPT_PLAN":  # right key, broken plan body
        doc = json.loads(path.read_text())
        del doc["plan"]["layers"][0]["shape"]
        garbage = json.dumps(doc)
    path.write_text(garbage)
    with capture_logs() as logs:
        plan, hit, n = _plan(tmp_path)
    assert not hit and n > 0
    ignored = [e for e in logs if e["event"] == "precision_plan_cache_ignored"]
    assert ignored and ignored[0]["reason"], logs
    assert plan.precisions("easy") == first.precisions("easy")
    assert json.loads(path.read_text())["plan"]["layers"][0]["shape"]  # rewritten whole


def test_cache_path_is_stable_and_under_the_dir(tmp_path: Path) -> None:
    k = plan_key(model_hash="a", backend="torch", candidates=("w8a8",), budget=0.05)
    assert cache_path(tmp_path, k) == cache_path(tmp_path, dict(k))
    assert cache_path(tmp_path, k).parent == tmp_path


def test_apply_plan_relowers_in_place_and_keeps_lora_parameters(tmp_path: Path) -> None:
    from lorad.kernels import apply_plan

    model, _, weights = _setup()
    plan, _, _ = _plan(tmp_path, candidates=("w8a16",), budget=0.02)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n = apply_plan(model, plan, weights, backend="torch")
    assert n == sum(plan.precisions(k) != ("fp32", "fp32") for k in weights) and n >= 1
    assert (model.easy.frozen.precision_fwd, model.easy.frozen.precision_bwd) == plan.precisions("easy")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert apply_plan(model, plan, weights, backend="torch") == 0  # already lowered
