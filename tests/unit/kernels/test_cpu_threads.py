"""torch's OpenMP workers next to ORT's own pool: a daemon on ort-cpu makes them sleep when idle (before torch loads),
and its models then train with torch on every core; where they spin, torch stays on one thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorad.kernels import cpu_threads
from lorad.kernels.cpu_threads import WAIT_POLICY, prefer_sleeping_workers, torch_threads_for, workers_sleep
from tests.fixtures.tiny_hf import save_tiny_hf

# A process as the daemon runs one: the backend decided first, a model built on it later (torch loads then).
_CHILD = """
import json, sys
from pathlib import Path
if sys.argv[3] == "torch-first":
    import torch
from lorad.server.backend import decide_backend
decision = decide_backend(sys.argv[1])
from lorad.server.engine.api import LoraConfig, load_model
model = Path(sys.argv[2])
loaded = load_model(model, cache_root=model.parent / "cache", backend=decision.name, lora=LoraConfig(rank=2, alpha=4.0))
print(json.dumps({"backend": decision.name, "torch_threads": loaded.model.torch_threads}))
"""


def _child(tmp_path: Path, backend: str, *, order: str = "decide-first", **env: str) -> tuple[dict, int]:
    """(the child's JSON line, the spin count libgomp reports as it loads: 0 when idle workers sleep at once)."""
    marker = tmp_path / "model"
    if not marker.exists():
        marker.write_text(str(save_tiny_hf(tmp_path, "llama")))
    model = Path(marker.read_text())
    base = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY, "GOMP_SPINCOUNT") and "LORAD_" not in k}
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, backend, str(model), order],
        env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    spins = [ln.split("=", 1)[1].strip(" '") for ln in p.stderr.splitlines() if ln.strip().startswith("GOMP_SPINCOUNT")]
    assert len(spins) == 1, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), int(spins[0])


def test_a_daemon_on_ort_cpu_makes_idle_torch_workers_sleep_and_trains_on_every_core(tmp_path: Path) -> None:
    """The policy is in place before libgomp reads it (libgomp itself reports it), so the model does not hold torch
    to one thread; deciding for the torch backend leaves libgomp's default (spinning pays there)."""
    got, spins = _child(tmp_path, "ort-cpu")
    assert (got, spins) == ({"backend": "ort-cpu", "torch_threads": 0}, 0)
    got, spins = _child(tmp_path, "torch")
    assert got == {"backend": "torch", "torch_threads": 0}
    assert spins > 0


def test_a_users_policy_or_torch_loaded_first_keeps_torch_on_one_thread_next_to_ort(tmp_path: Path) -> None:
    """A policy the user set decides (spinning workers: torch stays on one thread beside ORT's pool); a process that
    loaded torch before deciding cannot change libgomp's policy any more and does not pretend it did."""
    got, spins = _child(tmp_path, "ort-cpu", OMP_WAIT_POLICY="ACTIVE")
    assert (got["torch_threads"], spins > 0) == (1, True)
    got, spins = _child(tmp_path, "ort-cpu", order="torch-first")
    assert (got["torch_threads"], spins > 0) == (1, True)


@pytest.mark.parametrize(
    ("backend", "env", "asked", "threads"),
    [
        ("ort-cpu", {}, "PASSIVE", 0),
        ("ort-cpu", {WAIT_POLICY: "active"}, "active", 1),
        ("ort-cpu", {WAIT_POLICY: "passive"}, "passive", 0),
        ("torch", {}, None, 0),
        ("qnn-htp", {}, None, 0),
    ],
)
def test_which_backends_ask_for_sleeping_workers(
    backend: str, env: dict[str, str], asked: str | None, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a backend with a CPU pool of its own asks; a policy already there is never overwritten (a mapping
    stands in for the environment of a process that has not loaded torch yet)."""
    monkeypatch.setattr(cpu_threads, "torch_loaded", lambda: False)
    environ = dict(env)
    prefer_sleeping_workers(backend, environ)
    assert environ.get(WAIT_POLICY) == asked
    assert torch_threads_for(backend, environ) == threads


def test_nothing_is_asked_once_torch_is_loaded() -> None:
    environ: dict[str, str] = {}
    assert not prefer_sleeping_workers("ort-cpu", environ)
    assert environ == {} and not workers_sleep(environ)
    assert torch_threads_for("ort-cpu", environ) == 1
