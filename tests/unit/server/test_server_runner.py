"""The job runner on a real store with scripted sessions: start messages, restart recovery, RUNNING hooks."""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lorad.server.device.probes import Readings
from lorad.server.engine.api import HEARTBEAT_PERIOD_S, Heartbeat
from lorad.server.engine.training.config import job_config
from lorad.server.jobs import EventHub, Layout, Runner
from lorad.server.jobs.session import AdapterArtifact, SessionOutcome, SessionRequest, SessionSink
from lorad.server.records import Blocked, EventKind, Job, JobSpec, JobState, Phase, Quota, Requirements
from lorad.server.store import AdapterRepo, AppRepo, Database, JobRepo, SampleRepo

SPEC = JobSpec(("ds",), job_config({"steps": 3}), Requirements(False, 0, 80.0, False))
GOOD = Readings(battery_percent=90, charging=True, temperature_celsius=30.0, idle=True, source="test")


class Paused:
    """A session that waits until told to stop, then reports a pause (a checkpoint would be written here)."""

    def __init__(self, started: threading.Event) -> None:
        self.started = started

    def run(self, should_stop: Callable[[], bool], sink: SessionSink) -> SessionOutcome:
        self.started.set()
        while not should_stop():
            time.sleep(0.01)
        return SessionOutcome(completed=False)


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class World:
    def __init__(self, tmp: Path) -> None:
        self.db = Database(tmp / "s.sqlite")
        self.tmp = tmp
        self.jobs = JobRepo(self.db)
        AppRepo(self.db).create("app", "App", "h" * 64, Quota(10, 10_000, 2, 4))
        self.started = threading.Event()
        self.requests: list[SessionRequest] = []
        self.hook: list[bool] = []

    def runner(self, backend_for: Callable[[Job], tuple[str, str]] | None = None) -> Runner:
        def factory(req: SessionRequest) -> Paused:
            self.requests.append(req)
            return Paused(self.started)

        return Runner(self.jobs, SampleRepo(self.db), AdapterRepo(self.db), Layout(self.tmp), factory, EventHub(),
                      lambda: GOOD, 2, backend_for=backend_for, on_running=self.hook.append)  # fmt: skip

    def job(self, rid: str = "r") -> Job:
        job, _ = self.jobs.create("app", rid, SPEC, JobState.QUEUED, Blocked.NONE, 4)
        return job

    def messages(self, job_id: str) -> list[str]:
        evs, _ = self.jobs.events(job_id, 0, 1000)
        return [e.message for e in evs if e.kind is EventKind.STATE_CHANGED]


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_start_message_names_the_backend_and_the_fallback_reason(world: World) -> None:
    why = "QNN HTP EP loads but only as the x86 simulator; using ORT CPU EP"
    r = world.runner(backend_for=lambda job: ("ort-cpu", why))
    job = world.job()
    r.start()
    assert world.started.wait(10)
    msgs = world.messages(job.job_id)
    assert f"started on ort-cpu: {why}" in msgs, msgs
    assert not any("NPU" in m for m in msgs), msgs
    assert r.close(10)


def test_running_hook_fires_on_enter_and_leave(world: World) -> None:
    r = world.runner()
    job = world.job()
    r.start()
    assert world.started.wait(10)
    assert world.hook == [True]
    assert r.request_pause(job.job_id, JobState.PAUSED, Blocked.PAUSED_BY_USER, "paused by the app")
    _wait(lambda: world.jobs.get(job.job_id).state is JobState.PAUSED, "paused")
    _wait(lambda: world.hook == [True, False], "release after the session ended")
    assert r.close(10)


def test_a_user_pause_in_progress_survives_a_daemon_kill(world: World) -> None:
    job = world.job()
    world.jobs.transition(job.job_id, (JobState.QUEUED,), JobState.RUNNING)
    world.jobs.transition(job.job_id, (JobState.RUNNING,), JobState.PAUSING, blocked=Blocked.PAUSED_BY_USER,
                          detail="paused by the app")  # fmt: skip
    # ... and the daemon was killed here. A new one starts:
    r = world.runner()
    r.start()
    got = world.jobs.get(job.job_id)
    assert (got.state, got.blocked) == (JobState.PAUSED, Blocked.PAUSED_BY_USER)
    assert any("paused, resume continues from the start" in m for m in world.messages(job.job_id))
    time.sleep(0.2)
    assert world.requests == [], "a paused job does not train"
    assert r.close(10)


def test_a_condition_pause_in_progress_is_queued_again_after_a_kill(world: World) -> None:
    job = world.job()
    world.jobs.transition(job.job_id, (JobState.QUEUED,), JobState.RUNNING)
    world.jobs.transition(job.job_id, (JobState.RUNNING,), JobState.PAUSING, blocked=Blocked.NOT_CHARGING)
    r = world.runner()
    r.start()
    assert world.started.wait(10), "conditions hold now: the job trains again"
    assert r.close(10)
    assert world.jobs.get(job.job_id).state is JobState.QUEUED


def test_a_user_pause_in_progress_survives_a_graceful_stop(world: World) -> None:
    r = world.runner()
    job = world.job()
    r.start()
    assert world.started.wait(10)
    assert r.request_pause(job.job_id, JobState.PAUSED, Blocked.PAUSED_BY_USER, "paused by the app")
    assert r.close(10)
    got = world.jobs.get(job.job_id)
    assert (got.state, got.blocked) == (JobState.PAUSED, Blocked.PAUSED_BY_USER)


def test_restart_names_the_checkpoint_file_the_job_resumes_from(world: World) -> None:
    """A kill between writing checkpoint 6 and recording it: the store knows step 3, the folder holds 6, and the
    engine resumes from 6; the restart message says 6 too."""
    from lorad.server.engine.api import checkpoint_dir
    from lorad.server.records import CheckpointRec

    job = world.job()
    world.jobs.transition(job.job_id, (JobState.QUEUED,), JobState.RUNNING)
    ckdir = checkpoint_dir(Layout(world.tmp).job_dir("app", job.job_id))
    ckdir.mkdir(parents=True)
    for step in (3, 6):
        (ckdir / f"step-{step:08d}.pt").write_bytes(b"x")
    (ckdir / ".tmp-step-00000009.pt").write_bytes(b"half")  # an interrupted write is not a checkpoint
    rec = CheckpointRec("ckpt-3", job.job_id, 3, 0, 1, 1.0, str(ckdir / "step-00000003.pt"))
    world.jobs.record(job.job_id, EventKind.CHECKPOINT, checkpoint=rec, message="checkpoint at step 3")
    r = world.runner()
    r.start()
    assert "daemon restarted; resumes from checkpoint step 6" in world.messages(job.job_id)
    assert r.close(10)


def test_a_job_told_to_stop_before_the_worker_took_it_up_finishes_its_pause(world: World) -> None:
    # The stop lands between the start decision and the worker thread: here from the RUNNING hook, which reconcile
    # calls under its lock, so the worker cannot have taken the job up yet (a charger unplugged at that instant).
    r = world.runner()
    job = world.job()

    def stop_at_once(running: bool) -> None:
        world.hook.append(running)
        if running:
            assert r.request_pause(job.job_id, JobState.PAUSED, Blocked.PAUSED_BY_USER, "paused by the user")

    r.on_running = stop_at_once
    r.start()
    try:
        _wait(lambda: world.jobs.get(job.job_id).state is JobState.PAUSED, "the pause to finish")
        assert world.jobs.get(job.job_id).blocked is Blocked.PAUSED_BY_USER
        assert world.requests == [], "a job stopped before it started ran a session"
    finally:
        r.close(5)


class _Killed(BaseException):
    """The daemon dying inside a transaction: like a kill -9, nothing after it in the transaction is committed."""


def _artifact(folder: Path) -> AdapterArtifact:
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return AdapterArtifact(folder, "tiny", "m" * 64, "t" * 64, 3, 1.0, 2.0, 1.5, 4)


class Completing:
    """A session that finishes at once with an adapter folder in the job's work dir."""

    def __init__(self, work: Path) -> None:
        self.work = work

    def run(self, should_stop: Callable[[], bool], sink: SessionSink) -> SessionOutcome:
        return SessionOutcome(completed=True, adapter=_artifact(self.work / f"out-{time.monotonic_ns()}"))


def test_a_kill_while_registering_the_adapter_leaves_neither_and_the_restart_makes_one(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter's record and the job's SUCCEEDED are one commit. Were they two, a kill between them would list an
    adapter while the job, still RUNNING, resumed at the restart and made a second one (a reliability run saw it)."""
    import lorad.server.store.jobs as job_store
    from lorad.server.disk import remove_stranded

    adapters, layout = AdapterRepo(world.db), Layout(world.tmp)
    job = world.job()
    world.jobs.transition(job.job_id, (JobState.QUEUED,), JobState.RUNNING)
    real = job_store._insert_event

    def dying(c: object, j: Job, *args: object, **kw: object) -> object:
        if j.state is JobState.SUCCEEDED:
            raise _Killed
        return real(c, j, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(job_store, "_insert_event", dying)
    with pytest.raises(_Killed):
        world.runner()._succeed(job.job_id, _artifact(world.tmp / "first"))
    monkeypatch.undo()
    assert adapters.count("app") == 0
    assert world.jobs.get(job.job_id).state is JobState.RUNNING
    (moved,) = (layout.app_dir("app") / "adapters").iterdir()  # the folder was moved into place before the commit

    # The next start: the unregistered folder goes, the job resumes and succeeds once.
    assert remove_stranded(layout, adapters.ids) == [moved]
    r = Runner(world.jobs, SampleRepo(world.db), adapters, layout, lambda req: Completing(req.work_dir), EventHub(),
               lambda: GOOD, 2)  # fmt: skip
    r.start()
    _wait(lambda: world.jobs.get(job.job_id).state is JobState.SUCCEEDED, "the resumed job to finish")
    assert r.close(10)
    done = world.jobs.get(job.job_id)
    assert adapters.ids("app") == {done.adapter_id}
    assert [p.name for p in (layout.app_dir("app") / "adapters").iterdir()] == [done.adapter_id]
    assert sum(e.message == f"adapter {done.adapter_id} ready" for e in world.jobs.events(job.job_id, 0, 100)[0]) == 1


def test_a_cancel_that_lands_while_the_adapter_is_moved_into_place_registers_nothing(world: World) -> None:
    job = world.job()
    world.jobs.transition(job.job_id, (JobState.QUEUED,), JobState.RUNNING)
    r = world.runner()
    layout = Layout(world.tmp)
    ck = layout.job_dir("app", job.job_id) / "checkpoints" / "step-00000003.pt"
    ck.parent.mkdir(parents=True)
    ck.write_bytes(b"adapter state")
    seen = world.jobs.get(job.job_id)
    reads = iter([seen])  # the runner read RUNNING; the cancel came after
    r._get = lambda job_id: next(reads, None) or world.jobs.get(job_id)  # type: ignore[method-assign]
    world.jobs.transition(job.job_id, (JobState.RUNNING,), JobState.CANCELLED)
    r._succeed(job.job_id, _artifact(world.tmp / "late"))
    got = world.jobs.get(job.job_id)
    assert (got.state, got.adapter_id) == (JobState.CANCELLED, "")
    assert AdapterRepo(world.db).count("app") == 0
    assert list((layout.app_dir("app") / "adapters").iterdir()) == []
    assert not layout.job_dir("app", job.job_id).exists(), "the cancelled job's checkpoints go with it"


@pytest.mark.parametrize("final", [JobState.SUCCEEDED, JobState.CANCELLED])
def test_a_start_removes_the_checkpoints_a_kill_left_after_a_job_ended(world: World, final: JobState) -> None:
    """Killed after the job's final commit, before its work folder went: the checkpoints (trained on the user's
    data) go at the next start, files and records. A failed job keeps them."""
    from lorad.server.records import CheckpointRec

    layout = Layout(world.tmp)
    ended, failed = world.job("ended"), world.job("failed")
    for job, to in ((ended, final), (failed, JobState.FAILED)):
        world.jobs.transition(job.job_id, (JobState.QUEUED,), JobState.RUNNING)
        ck = layout.job_dir("app", job.job_id) / "checkpoints" / "step-00000003.pt"
        ck.parent.mkdir(parents=True)
        ck.write_bytes(b"adapter state")
        rec = CheckpointRec(f"ck-{job.job_id}", job.job_id, 3, 0, 13, 1.0, str(ck))
        world.jobs.record(job.job_id, EventKind.CHECKPOINT, checkpoint=rec, message="checkpoint at step 3")
        world.jobs.transition(job.job_id, (JobState.RUNNING,), to)
    r = world.runner()
    r.start()
    assert r.close(10)
    assert not layout.job_dir("app", ended.job_id).exists()
    assert world.jobs.checkpoints(ended.job_id) == []
    assert layout.job_dir("app", failed.job_id).is_dir() and len(world.jobs.checkpoints(failed.job_id)) == 1


@pytest.mark.parametrize(
    ("error", "state", "code", "says"),
    [
        (sqlite3.OperationalError("database or disk is full"), JobState.WAITING, "", "no space left on the device"),
        (RuntimeError("store exploded"), JobState.FAILED, "internal", "RuntimeError: store exploded"),
    ],
    ids=["disk-full", "other"],
)
def test_a_job_whose_result_cannot_be_recorded_fails_with_the_cause_or_waits_for_disk(
    world: World, monkeypatch: pytest.MonkeyPatch, error: Exception, state: JobState, code: str, says: str
) -> None:
    """The commit of a finished job raises: the job ends FAILED naming why, or on a full disk waits for space (not
    RUNNING with no worker on it), and the adapter folder moved into place for it goes."""
    layout = Layout(world.tmp)

    def failing(*_args: object, **_kw: object) -> None:
        raise error

    monkeypatch.setattr(world.jobs, "succeed", failing)
    job = world.job()
    # free: the disk stays full, so a waiting job does not start again
    r = Runner(world.jobs, SampleRepo(world.db), AdapterRepo(world.db), layout, lambda req: Completing(req.work_dir),
               EventHub(), lambda: GOOD, 2, free=lambda _p: 0)  # fmt: skip
    r.start()
    try:
        _wait(lambda: world.jobs.get(job.job_id).state is state, f"the job to be {state.name}")
    finally:
        assert r.close(10)
    got = world.jobs.get(job.job_id)
    assert got.error_code == code
    assert says in (got.error_message if code else got.blocked_detail)
    assert got.blocked is (Blocked.DISK_FULL if state is JobState.WAITING else Blocked.NONE)
    assert AdapterRepo(world.db).count("app") == 0
    assert list((layout.app_dir("app") / "adapters").iterdir()) == []


class _Scripted:
    """A session that raises ``error`` at its first run and completes at the next; every run is counted."""

    def __init__(self, work: Path, runs: list[Path], error: BaseException) -> None:
        self.work, self.runs, self.error = work, runs, error

    def run(self, should_stop: Callable[[], bool], sink: SessionSink) -> SessionOutcome:
        self.runs.append(self.work)
        if len(self.runs) == 1:
            raise self.error
        return SessionOutcome(completed=True, adapter=_artifact(self.work / f"out-{time.monotonic_ns()}"))


@pytest.mark.parametrize(
    "error",
    [OSError(28, "No space left on device"), RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")],
    ids=["enospc", "torch-save-on-a-full-disk"],
)
def test_a_job_that_runs_out_of_disk_waits_for_space_then_continues(world: World, error: BaseException) -> None:
    """A full disk mid-job (a checkpoint or the adapter not written) is no failure: the job waits, DISK_FULL, with the
    space it needs named, starts nothing while that space is missing, and runs again once it is there. torch.save
    reports a full disk as a RuntimeError of its own: the free space decides then."""
    layout, runs, free = Layout(world.tmp), [], [0]
    r = Runner(world.jobs, SampleRepo(world.db), AdapterRepo(world.db), layout,
               lambda req: _Scripted(req.work_dir, runs, error), EventHub(), lambda: GOOD, 2,
               free=lambda _p: free[0])  # fmt: skip
    job = world.job()  # with a checkpoint of 3 MiB it keeps: the next one needs room beside it
    ck = layout.job_dir("app", job.job_id) / "checkpoints" / "step-00000002.pt"
    ck.parent.mkdir(parents=True)
    ck.write_bytes(b"\0" * (3 << 20))
    r.start()
    try:
        _wait(lambda: world.jobs.get(job.job_id).state is JobState.WAITING, "the job to wait")
        got = world.jobs.get(job.job_id)
        assert got.blocked is Blocked.DISK_FULL and got.error_code == ""
        assert "once 14 MiB are free" in got.blocked_detail, got.blocked_detail  # 8 MiB reserve + 2 x 3 MiB
        free[0] = (14 << 20) - 1  # one byte short
        r.reconcile()
        time.sleep(0.2)
        assert len(runs) == 1 and world.jobs.get(job.job_id).blocked is Blocked.DISK_FULL
        free[0] = 14 << 20
        r.reconcile()
        _wait(lambda: world.jobs.get(job.job_id).state is JobState.SUCCEEDED, "the job to finish")
    finally:
        assert r.close(10)
    assert len(runs) == 2
    assert "waiting: no space left on the device" in " | ".join(world.messages(job.job_id))


def test_a_crash_with_room_on_the_disk_still_fails(world: World) -> None:
    runs: list[Path] = []
    r = Runner(world.jobs, SampleRepo(world.db), AdapterRepo(world.db), Layout(world.tmp),
               lambda req: _Scripted(req.work_dir, runs, RuntimeError("a bug")), EventHub(), lambda: GOOD, 2,
               free=lambda _p: 1 << 40)  # fmt: skip
    job = world.job()
    r.start()
    try:
        _wait(lambda: world.jobs.get(job.job_id).state.final, "the job to end")
    finally:
        assert r.close(10)
    got = world.jobs.get(job.job_id)
    assert (got.state, got.error_code, got.error_message) == (JobState.FAILED, "internal", "RuntimeError: a bug")


class Planning:
    """A session in a long planning phase as the engine runs one: its heartbeat repeats the fraction every period,
    and one real move comes 0.45 periods in; then it waits to be stopped."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done

    def run(self, should_stop: Callable[[], bool], sink: SessionSink) -> SessionOutcome:
        with Heartbeat(lambda f: sink.phase(Phase.PLANNING, f)) as beat:
            beat.set(0.0)
            time.sleep(0.45 * HEARTBEAT_PERIOD_S)
            beat.set(0.5)
            time.sleep(2.3 * HEARTBEAT_PERIOD_S)
        self.done.set()
        while not should_stop():
            time.sleep(0.01)
        return SessionOutcome(completed=False)


def test_a_listener_hears_from_a_slow_phase_every_heartbeat(world: World) -> None:
    """Every heartbeat repeat becomes an event even just after a fraction's own event: the gap between a slow phase's
    events stays near one heartbeat period (the budget is an event at least every 2 s). When the runner dropped
    repeats for a whole period after any event, the repeat after the move was dropped and the gap was ~1.55 periods
    here."""
    done = threading.Event()
    r = Runner(world.jobs, SampleRepo(world.db), AdapterRepo(world.db), Layout(world.tmp), lambda req: Planning(done),
               EventHub(), lambda: GOOD, 2)  # fmt: skip
    job = world.job()
    r.start()
    assert done.wait(30)
    evs, _ = world.jobs.events(job.job_id, 0, 1000)
    at = [e.time_ms / 1000 for e in evs if e.kind is EventKind.PHASE and e.progress.phase is Phase.PLANNING]
    assert len(at) >= 3, at
    gaps = [b - a for a, b in itertools.pairwise(at)]
    assert max(gaps) < 1.3 * HEARTBEAT_PERIOD_S, gaps
    assert r.close(10)
