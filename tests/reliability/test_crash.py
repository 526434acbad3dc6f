"""kill -9 at seeded random points during ingestion and training: no acknowledged sample lost, exact resume."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from lorad.v1 import adapters_pb2, jobs_pb2
from tests.reliability.harness import (
    FINAL,
    SubprocessDaemon,
    adapter_tensors,
    all_events,
    all_samples,
    append,
    chat,
    corpus,
    create_job,
    download,
    get_job,
    wait_state,
)

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

SEED = 20261202
STEP_KINDS = (jobs_pb2.JOB_EVENT_KIND_PROGRESS, jobs_pb2.JOB_EVENT_KIND_EVAL)  # an eval step is reported as EVAL
STEPS = 30
INGEST_ONLY_KILLS = 4
TRAIN_KILLS = 8  # plus one at the final step (adapter save) → 13 kill points in total


class Ingestor(threading.Thread):
    """Appends small unique batches until the daemon dies; remembers every acknowledged sample id and body."""

    def __init__(self, stubs, tag: str) -> None:
        super().__init__(daemon=True)
        self.stubs, self.tag = stubs, tag
        self.acked: dict[str, bytes] = {}
        self.stop = threading.Event()
        self.batches = 0

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            batch = [chat(f"ingest {self.tag} {i} {k} question", f"answer {self.tag} {i} {k}") for k in range(5)]
            i += 1
            try:
                r = append(self.stubs, "ingest", batch, timeout=10)
            except grpc.RpcError:
                return  # the daemon was killed mid-call: that batch was never acknowledged
            for sid, s in zip(r.sample_ids, batch, strict=True):
                self.acked[sid] = s.SerializeToString(deterministic=True)
            self.batches += 1


def _check_disk(d: SubprocessDaemon, app_id: str) -> tuple[int, list[str]]:
    """With the daemon dead: every checkpoint file loads and every registered adapter folder is complete.

    Returns:
        (newest complete checkpoint step on disk, or -1; problems found).
    """
    import sqlite3

    from lorad.server.engine.adapters import load_adapter
    from lorad.server.engine.training import checkpoint as ckpt

    problems: list[str] = []
    newest = -1
    for jd in (d.data_dir / "apps" / app_id / "jobs").glob("*"):
        for c in ckpt.list_checkpoints(jd / "checkpoints") if (jd / "checkpoints").is_dir() else []:
            try:
                ckpt.load(c.path)
            except Exception as exc:  # a half-written checkpoint under its final name
                problems.append(f"checkpoint {c.path.name} does not load: {exc}")
            newest = max(newest, c.step)
    conn = sqlite3.connect(f"file:{d.data_dir / 'lorad.sqlite'}?mode=ro", uri=True)
    try:
        paths = [r[0] for r in conn.execute("SELECT path FROM adapters")]
    finally:
        conn.close()
    for p in paths:
        try:
            load_adapter(Path(p))
        except Exception as exc:
            problems.append(f"registered adapter {p} does not load: {exc}")
    return newest, problems


def _unregistered_adapter_folders(d: SubprocessDaemon, app_id: str) -> list[str]:
    """Adapter folders on disk that no record names (the daemon's start removes what a kill left)."""
    import sqlite3

    conn = sqlite3.connect(f"file:{d.data_dir / 'lorad.sqlite'}?mode=ro", uri=True)
    try:
        known = {r[0] for r in conn.execute("SELECT adapter_id FROM adapters WHERE app_id=?", (app_id,))}
    finally:
        conn.close()
    root = d.data_dir / "apps" / app_id / "adapters"
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in known) if root.is_dir() else []


def _last_event_id(d: SubprocessDaemon) -> int:
    import sqlite3

    conn = sqlite3.connect(f"file:{d.data_dir / 'lorad.sqlite'}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT COALESCE(MAX(event_id), 0) FROM job_events").fetchone()[0])
    finally:
        conn.close()


def _kill_at_step(d: SubprocessDaemon, app, job_id: str, after_event: int, target: int, jitter_s: float) -> str:
    """Kills the daemon once a PROGRESS event with step >= target (newer than after_event) appears, or the job ends."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        evs = all_events(app, job_id, after_event)
        if any(e.kind in STEP_KINDS and e.progress.step >= target for e in evs):
            time.sleep(jitter_s)
            d.kill9()
            return "step"
        if get_job(app, job_id).state in FINAL:
            d.kill9()
            return "final"
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} never reached step {target}")


def test_kill9_during_ingestion_and_training(tmp_path: Path, tiny_llama: Path, tally) -> None:
    rng = random.Random(SEED)
    d = SubprocessDaemon(tmp_path / "crash", tiny_llama)
    d.start()
    app = d.register("alpha")
    token = app.token
    assert append(app, "train", corpus(24)).accepted_count == 36
    acked: dict[str, bytes] = {}
    survived = 0

    def restart_and_verify(where: str) -> None:
        nonlocal app, survived
        _newest, problems = _check_disk(d, "alpha")
        assert not problems, f"after kill ({where}): {problems}"
        d.start()
        app = d.stubs(token)
        stray = _unregistered_adapter_folders(d, "alpha")
        if stray:
            tally.violation(f"kill {where}: adapter folders no record names after the restart: {stray}")
        assert not stray
        stored = all_samples(app, "ingest") if acked else {}
        lost = [sid for sid in acked if sid not in stored]
        changed = [sid for sid in acked if sid in stored and stored[sid].SerializeToString(deterministic=True)
                   != acked[sid]]  # fmt: skip
        if lost or changed:
            tally.violation(f"kill {where}: {len(lost)} acknowledged samples lost, {len(changed)} changed")
        assert not lost and not changed
        survived += 1
        tally.crash_survived()

    # 1) kills during pure ingestion, at seeded random times.
    for k in range(INGEST_ONLY_KILLS):
        ing = Ingestor(app, f"i{k}")
        ing.start()
        time.sleep(rng.uniform(0.05, 0.8))
        d.kill9()
        ing.join(15)
        acked.update(ing.acked)
        restart_and_verify(f"ingest#{k}")

    # 2) kills during training (with ingestion running alongside), at seeded random steps.
    job = create_job(app, "crash-job", ("train",), steps=STEPS, checkpoint_every_steps=3, eval_every_steps=10)
    targets = [*sorted(rng.sample(range(1, STEPS), TRAIN_KILLS)), STEPS]
    resumed: list[tuple[int, int]] = []  # (newest checkpoint on disk at the kill, first step trained after restart)
    after = 0
    for k, target in enumerate(targets):
        ing = Ingestor(app, f"t{k}")
        ing.start()
        how = _kill_at_step(d, app, job.job_id, after, target, rng.uniform(0.0, 0.08))
        ing.join(15)
        acked.update(ing.acked)
        newest_ckpt, _ = _check_disk(d, "alpha")
        after = _last_event_id(d)  # read while the daemon is dead: everything later is the resumed run
        restart_and_verify(f"train#{k} step>={target} ({how})")
        if how == "final":
            break
        first = None
        deadline = time.monotonic() + 120
        while first is None and time.monotonic() < deadline:
            new = all_events(app, job.job_id, after)
            steps = [e.progress.step for e in new if e.kind in STEP_KINDS]
            if steps:
                first = steps[0]
            elif get_job(app, job.job_id).state in FINAL:
                break
            time.sleep(0.02)
        if first is not None:
            resumed.append((newest_ckpt, first))
            if first != newest_ckpt + 1 and not (newest_ckpt == -1 and first == 1):
                tally.violation(f"resume after kill #{k}: newest checkpoint step {newest_ckpt}, resumed at {first}")
            assert first == max(newest_ckpt, 0) + 1, (newest_ckpt, first)

    final = wait_state(app, job.job_id, FINAL, 180)
    assert final.state == jobs_pb2.JOB_STATE_SUCCEEDED, final.error
    notes = [e.message for e in all_events(app, job.job_id) if e.message]
    assert any("daemon restarted; resumes from checkpoint step" in m for m in notes), notes

    # No half-written adapter is visible: every listed adapter downloads with a matching sha256.
    listed = app.adapters.ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=app.md, timeout=10).adapters
    assert [a.adapter_id for a in listed] == [final.adapter_id]
    crashed = adapter_tensors(download(app, final.adapter_id))

    # The uninterrupted reference: same data, same config, same seed, same precision, never killed. The crashed job
    # was this model's first "auto" job, so it trained at the backend's unplanned precision (one "*" entry) while the
    # plan was measured after it; the reference pins that precision, so every resume must have kept it exactly.
    (used,) = listed[0].precision_plan
    assert used.layer == "*" and used.forward == used.backward, used
    ref_job = create_job(app, "reference-job", ("train",), steps=STEPS, checkpoint_every_steps=3, eval_every_steps=10,
                         precision=used.forward)  # fmt: skip
    ref = wait_state(app, ref_job.job_id, FINAL, 180)
    assert ref.state == jobs_pb2.JOB_STATE_SUCCEEDED, ref.error
    reference = adapter_tensors(download(app, ref.adapter_id))
    assert crashed.keys() == reference.keys()
    max_diff = max(float((crashed[k] - reference[k]).abs().max()) for k in crashed)
    tally.number("crash: final adapter max |diff| vs uninterrupted run", f"{max_diff:.3g}")
    tally.number("crash: resumes (newest checkpoint, first step after restart)", resumed)
    tally.number("crash: acknowledged samples checked", len(acked))
    for k in crashed:
        torch.testing.assert_close(crashed[k], reference[k], rtol=1e-4, atol=1e-6)
    assert survived >= 10
    assert d.stop() == 0
