"""CreateJob -> first training step through a real daemon: cold (no plan cached) and warm, optionally on a busy host.

A throwaway daemon (the demo's: temporary data dir, fake "plugged in" probe file) on a Unix socket; the default model
and the default precision ("auto"). One fresh data dir per run, so the first job is cold: the model is converted
from its GGUF once before (not timed: an install-time cost), then

- job 1 (cold): no plan is cached, so it trains at once at the backend's unplanned precision and measures the plan
  as its last phase, after its adapter is saved; it runs to the end (a few steps) so that planning happens,
- job 2 (warm): a job of the same shape on new data finds the plan cached and trains on it; cancelled after its
  first step.

Times are from the CreateJob call to the first PROGRESS event; the largest gap between two consecutive events before
the first step (and, for the cold job, over its whole run including planning) is reported too (the budget: an event
at least every 2 s). ``--busy N`` then repeats both jobs on a fresh daemon while N other processes spin, as a phone
doing something else would, and prints busy / quiet for each (the quiet run is its baseline, measured in the same
run).

    .venv/bin/python bench/first_step.py [--busy 2] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from typing import Any

from lorad.client.demo.daemon import PLUGGED_IN, DemoDaemon, write_probe
from lorad.client.demo.persona import load_samples
from lorad.client.sync_client import Client
from lorad.client.types import JobEventKind, JobPhase, JobState, LoraConfig, Precision, TrainingConfig

APP = "bench-first-step"


def _config(seed: int, steps: int) -> TrainingConfig:
    return TrainingConfig(lora=LoraConfig(rank=8, alpha=16.0), max_steps=steps, seq_len=256, seed=seed,
                          precision=Precision.AUTO)  # fmt: skip


def _first_step(c: Client, dataset: str, seed: int, *, to_end: bool) -> dict[str, Any]:
    """Creates a job; times CreateJob -> first step. ``to_end``: a 3-step job watched until it ends (planning after
    training included), else a 20-step job cancelled after its first step."""
    t0 = time.monotonic()
    job = c.create_job([dataset], _config(seed, 3 if to_end else 20))
    times: list[float] = [t0]
    phases: dict[str, float] = {}
    notices: list[str] = []
    first: float | None = None
    gaps_before: list[float] = []
    ended: float | None = None
    try:
        for u in c.watch(job):
            now = time.monotonic()
            ev = u.event
            if ev.phase is not JobPhase.UNSPECIFIED and ev.phase.value not in phases:
                phases[ev.phase.value] = now - t0
            if ev.kind is JobEventKind.NOTICE:
                notices.append(ev.message)
            times.append(now)
            if first is None and ev.kind is JobEventKind.PROGRESS and ev.progress.step >= 1:
                first = now - t0
                gaps_before = [b - a for a, b in itertools.pairwise(times)]
                if not to_end:
                    break
            if u.job.state is JobState.SUCCEEDED and first is not None:
                ended = now - t0
                break
            if u.job.state in (JobState.FAILED, JobState.CANCELLED, JobState.SUCCEEDED):
                raise RuntimeError(f"job ended {u.job.state.value} before its first step: {u.job.error}")
    finally:
        if not to_end:
            c.cancel_job(job)
    out: dict[str, Any] = {
        "create_to_first_step_s": first, "phase_started_s": phases, "max_event_gap_s": max(gaps_before, default=0.0),
        "events_before_first_step": len(gaps_before), "unplanned": any("no precision plan" in n for n in notices),
    }  # fmt: skip
    if to_end:
        out["max_event_gap_whole_job_s"] = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        if "planning" in phases and ended is not None:
            out["planning_after_training_s"] = ended - phases["planning"]
    return out


def _run(busy: int) -> dict[str, Any]:
    """A fresh daemon and data dir: the cold job, then the warm one, with ``busy`` processes spinning during both."""
    out: dict[str, Any] = {"busy_processes": busy}
    with DemoDaemon() as d:
        d.start()
        write_probe(d.probe_file, PLUGGED_IN)
        with Client.for_owner(d.data_dir, target=str(d.socket_path)) as owner:
            status = owner.wait_ready(120)
            token = owner.register_app(APP, "first-step bench").token
        out["backend"] = status.backend.backend.value
        samples = load_samples()
        with Client(str(d.socket_path), token, timeout=600) as c:
            c.append_samples("warmup", samples[:8])
            t = time.monotonic()
            c.generate_text("Hello", max_tokens=1)  # loads (and on a fresh data dir converts) the model: not timed
            out["model_load_s"] = time.monotonic() - t
            c.append_samples("notes-a", samples[: len(samples) // 2])
            c.append_samples("notes-b", samples[len(samples) // 2 :])
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                out["cold"] = _first_step(c, "notes-a", 1, to_end=True)
                out["warm"] = _first_step(c, "notes-b", 2, to_end=False)  # new data, same model and adapter shape
                if out["warm"]["unplanned"]:
                    raise RuntimeError("the warm job found no plan: the cold job's planning did not cache one")
            finally:
                for b in spinners:
                    b.kill()
    return out


def _report(label: str, out: dict[str, Any]) -> None:
    for k in ("cold", "warm"):
        r = out[k]
        phases = ", ".join(f"{p} {s:.1f} s" for p, s in r["phase_started_s"].items())
        gap, n = r["max_event_gap_s"], r["events_before_first_step"]
        print(f"{label} {k:4s}: CreateJob -> first step {r['create_to_first_step_s']:.1f} s; phases started at "
              f"{phases}; largest gap between events {gap:.2f} s ({n} events)")  # fmt: skip
        if "planning_after_training_s" in r:
            print(f"{label} {k:4s}: planning after training took {r['planning_after_training_s']:.1f} s; largest "
                  f"gap between events over the whole job {r['max_event_gap_whole_job_s']:.2f} s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", type=int, default=0, help="also run both jobs again with N processes spinning")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    a = ap.parse_args()
    quiet = _run(0)
    _report("quiet", quiet)
    out: dict[str, Any] = {"backend": quiet["backend"], "model_load_s": quiet["model_load_s"], "quiet": quiet}
    if a.busy:
        busy = _run(a.busy)  # its baseline, the quiet run, ran just before on this machine
        _report(f"busy ({a.busy})", busy)
        out["busy"] = busy
        for k in ("cold", "warm"):
            ratio = busy[k]["create_to_first_step_s"] / quiet[k]["create_to_first_step_s"]
            out[f"busy_over_quiet_{k}"] = ratio
            print(f"{k}: busy / quiet = {ratio:.2f}x")
    print(f"backend {out['backend']}, model load {out['model_load_s']:.1f} s (not counted)")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
