"""The measured cost table: every entry timed for real, precisions of a shape in alternation, busy tables not kept."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lorad.kernels import costs

SHAPES = [(24, 16), (8, 16)]


def test_measures_every_entry_and_caches_a_quiet_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = costs._interleaved
    shares: list[float] = []

    def quiet(calls: Any, repeats: int, min_ms: float = 0.0) -> tuple[dict[str, float], float, float]:
        best, cpu, wall = real(calls, repeats, min_ms)  # every entry timed for real
        shares.append(cpu / wall)
        return best, wall, wall  # reported as a quiet host, whatever the test machine's load: the cache path runs

    monkeypatch.setattr(costs, "_interleaved", quiet)
    table = costs.measure("torch", SHAPES, ("fp32", "bf16"), rows=32, cache_dir=tmp_path)
    assert set(table.ms) == {
        costs.CostTable.key(s, p, d) for s in SHAPES for p in ("fp32", "bf16") for d in ("fwd", "bwd")
    }
    assert all(v > 0 and math.isfinite(v) for v in table.ms.values())
    assert shares and all(x > 0 and math.isfinite(x) for x in shares), "the timing thread's real CPU share"
    assert table.cpu_share == pytest.approx(1.0) and not table.busy
    (cached,) = tmp_path.glob("costs-*.json")
    assert json.loads(cached.read_text())["ms"] == pytest.approx(table.ms)

    def fail(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a cached entry was timed again")

    monkeypatch.setattr(costs, "_interleaved", fail)
    again = costs.measure("torch", SHAPES, ("fp32", "bf16"), rows=32, cache_dir=tmp_path)
    assert again.ms == pytest.approx(table.ms) and math.isnan(again.cpu_share) and not again.busy


def test_a_table_timed_on_a_busy_host_is_used_but_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = costs._interleaved

    def starved(calls: Any, repeats: int, min_ms: float = 0.0) -> tuple[dict[str, float], float, float]:
        best, _cpu, wall = real(calls, repeats, min_ms)
        return best, 0.3 * wall, wall  # the timing thread ran 30 % of the time

    monkeypatch.setattr(costs, "_interleaved", starved)
    table = costs.measure("torch", SHAPES, ("fp32",), rows=32, cache_dir=tmp_path)
    assert table.busy and table.cpu_share == pytest.approx(0.3)
    assert len(table.ms) == 4  # the plan at hand still gets every entry
    assert not list(tmp_path.glob("costs-*.json"))


def test_precisions_of_one_shape_are_timed_in_alternation() -> None:
    order: list[str] = []

    def call(name: str) -> Any:
        def fn(a: torch.Tensor) -> torch.Tensor:
            order.append(name)
            return a

        return fn

    calls = [(n, call(n), torch.zeros(1)) for n in ("fp32|fwd", "bf16|fwd", "w8a8|fwd")]
    best, cpu_s, wall_s = costs._interleaved(calls, repeats=3)
    assert order == ["fp32|fwd", "bf16|fwd", "w8a8|fwd"] * 4  # one warm-up round, then three timed rounds in turn
    assert set(best) == {"fp32|fwd", "bf16|fwd", "w8a8|fwd"} and wall_s >= 0 and cpu_s >= 0
    order.clear()

    def slow(a: torch.Tensor) -> torch.Tensor:
        order.append("slow")
        time.sleep(0.002)
        return a

    costs._interleaved([("slow", slow, torch.zeros(1))], repeats=3, min_ms=30.0)  # cheap calls: more rounds
    assert 1 + 3 < len(order) <= 1 + 16  # 2 ms each: ~15 rounds fill 30 ms
    order.clear()
    costs._interleaved([("slow", slow, torch.zeros(1))], repeats=3, min_ms=1.0)  # the repeats are a floor
    assert len(order) == 1 + 3


def test_the_cpu_share_probe_sees_other_processes_take_the_cores() -> None:
    import os
    import subprocess
    import sys

    assert math.isnan(costs.cpu_share_now("qnn-htp"))  # an NPU call sleeps the caller: no verdict there
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        busy = costs.cpu_share_now("torch", seconds=0.5)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert busy < costs.BUSY_SHARE, busy


def test_every_shape_is_timed_in_passes_and_keeps_its_fastest_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow first pass (a fresh process's first second) must not price the table: each entry keeps its minimum."""
    seen: list[tuple[int, int]] = []

    def fake(calls: Any, repeats: int, min_ms: float = 0.0) -> tuple[dict[str, float], float, float]:
        assert min_ms == costs.MIN_ROUND_MS
        seen.append(tuple(int(v) for v in calls[0][0].split("|")[0].split("x")))
        return {name: next(per_pass) if i == 0 else 1.0 for i, (name, _, _) in enumerate(calls)}, 1.0, 1.0

    per_pass = iter([5.0, 5.0, 2.0, 2.0, 3.0, 3.0])  # both shapes: pass 1 slow, pass 2 fastest, pass 3 between
    monkeypatch.setattr(costs, "_interleaved", fake)
    table = costs.measure("torch", SHAPES, ("fp32",), rows=32)
    assert seen == sorted(set(SHAPES)) * costs.PASSES  # all shapes in each pass, not one shape three times
    for shape in set(SHAPES):
        assert table.get(shape, "fp32", "fwd") == pytest.approx(2.0) and table.get(shape, "fp32", "bwd") == 1.0
