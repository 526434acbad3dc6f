"""The job runner: owns the NPU (one job at a time on one worker thread) and decides who runs, queues or waits.

Why a thread and not a subprocess per job: the daemon keeps one loaded base model that training and Generate share
(a subprocess would load ~0.3 GB per job on a phone and could not share it), pause is a flag checked at step
boundaries, and a Python-level failure is caught and recorded as the job's error. A native crash would take the
daemon down, but the service manager restarts it and the job resumes from its last checkpoint (the same path as a
kill -9), so no acknowledged data or finished step beyond the last checkpoint is lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from lorad.server.device.conditions import Verdict, evaluate
from lorad.server.device.probes import Readings
from lorad.server.engine.api import HEARTBEAT_PERIOD_S
from lorad.server.errors import FailedPrecondition, NotFound
from lorad.server.intents import SpaceReserve
from lorad.server.jobs.files import Layout, free_bytes, largest_file, remove_tree, scrub_paths, tree_size
from lorad.server.jobs.hub import EventHub
from lorad.server.jobs.session import AdapterArtifact, JobFailure, SessionFactory, SessionRequest
from lorad.server.records import (
    AdapterRec,
    Blocked,
    CheckpointRec,
    DataSummary,
    EventKind,
    Job,
    JobState,
    Phase,
    Progress,
    Requirements,
)
from lorad.server.store import AdapterRepo, JobRepo, SampleRepo
from lorad.server.store.db import new_id, now_ms
from lorad.server.store.purge import is_disk_full

log = structlog.get_logger(__name__)

ELIGIBLE = (JobState.QUEUED, JobState.WAITING)
ON_NPU = (JobState.RUNNING, JobState.PAUSING)

DISK_RESERVE_BYTES = 8 << 20
"""A job that stopped on a full disk starts again once its filesystem has this much free beyond twice its largest file
(a checkpoint, or the adapter it was building): room for the next checkpoint next to the last one, for SQLite's
events and for the daemon's space reserve (4 MiB) made again. Until then it waits (``Blocked.DISK_FULL``) instead of
failing, so a night's steps up to its last checkpoint are kept."""


def disk_needed(work: Path) -> int:
    """Free bytes a job waiting for disk needs before it starts again (``DISK_RESERVE_BYTES``)."""
    return DISK_RESERVE_BYTES + 2 * largest_file(work)


class Runner:
    """Runs jobs one at a time on a dedicated thread; ``reconcile()`` applies the device conditions to the queue."""

    def __init__(  # noqa: PLR0917
        self,
        jobs: JobRepo,
        samples: SampleRepo,
        adapters: AdapterRepo,
        layout: Layout,
        factory: SessionFactory,
        hub: EventHub,
        readings: Callable[[], Readings],
        keep_checkpoints: int = 2,
        backend_for: Callable[[Job], tuple[str, str]] | None = None,
        on_running: Callable[[bool], None] | None = None,
        judge: Callable[[Readings, Requirements], Verdict] = evaluate,
        free: Callable[[Path], int] = free_bytes,
        reserve: SpaceReserve | None = None,
    ) -> None:
        """``backend_for(job)`` names the compute backend a job will train on and why (for its start event);
        ``on_running(True/False)`` is called when a job enters / leaves RUNNING (the wake-lock hooks);
        ``judge`` applies the device profile's policy to the readings; ``free(path)`` is the free space there;
        ``reserve`` is the daemon's space reserve, given up to record that a job waits for disk when nothing else
        could be written, and made again before such a job starts."""
        self.jobs, self.samples, self.adapters, self.layout = jobs, samples, adapters, layout
        self.factory, self.hub, self.readings, self.keep = factory, hub, readings, keep_checkpoints
        self.backend_for, self.on_running, self.judge, self.free = backend_for, on_running, judge, free
        self.reserve = reserve
        self._lock = threading.RLock()
        self._current: str | None = None
        self._current_app: str | None = None
        self._idle = threading.Condition(self._lock)  # notified when the worker leaves a job
        self._barred_apps: dict[str, int] = {}  # app -> purges in progress: none of its jobs may start
        self._barred_jobs: set[str] = set()
        self._stop = threading.Event()  # the running session's pause flag
        self._target: tuple[JobState, Blocked, str] | None = None  # where the current job goes once paused
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="lorad-npu", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Recovers what a stop or kill left, then starts the worker.

        Jobs that were on the NPU are queued (or paused) again; succeeded and cancelled jobs' checkpoints are removed.
        """
        from lorad.server.engine.api import checkpoint_dir, latest_checkpoint

        for job in self.jobs.in_states(ON_NPU):
            # What the job will resume from is the newest complete checkpoint file, which a kill can leave one step
            # ahead of the store's records (written, not yet recorded): say that one, as the engine will.
            ck = latest_checkpoint(checkpoint_dir(self.layout.job_dir(job.app_id, job.job_id)))
            where = f"from checkpoint step {ck.step}" if ck else "from the start (no checkpoint)"
            if job.state is JobState.PAUSING and job.blocked is Blocked.PAUSED_BY_USER:
                # The user's pause stands: the job waits for ResumeJob, then continues from its last checkpoint.
                self._move(
                    job.job_id,
                    ON_NPU,
                    JobState.PAUSED,
                    Blocked.PAUSED_BY_USER,
                    job.blocked_detail,
                    f"daemon restarted while pausing; paused, resume continues {where}",
                )
            else:
                self._move(job.job_id, ON_NPU, JobState.QUEUED, Blocked.NONE, "", f"daemon restarted; resumes {where}")
            log.info(
                "job_recovered",
                job_id=job.job_id,
                checkpoint_step=ck.step if ck else None,
                paused=job.state is JobState.PAUSING and job.blocked is Blocked.PAUSED_BY_USER,
            )
        for work in self.layout.job_dirs():  # the few work folders, not every job ever recorded
            # A kill after the final commit and before its checkpoints went: they go now (FAILED keeps them).
            done = self._get(work.name)
            if done is not None and done.state in (JobState.SUCCEEDED, JobState.CANCELLED):
                self._drop_checkpoints(done)
                log.info("job_leftovers_removed", job_id=done.job_id, state=done.state.value)
        self._thread.start()
        self.reconcile()

    def close(self, timeout_s: float) -> bool:
        """Checkpoints the running job (it is queued again for the next start) and stops the worker.

        Returns:
            True if the worker stopped within ``timeout_s`` seconds.
        """
        with self._lock:
            self._closing = True
            if self._target is not None and self._target[1] is Blocked.PAUSED_BY_USER:
                self._stop.set()  # a user's pause in progress stands: the job ends PAUSED, not queued
            elif self._current is not None:
                self._request_stop(self._current, JobState.QUEUED, Blocked.NONE, "daemon stopping; resumes on start")
        self._wake.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _barred(self, app_id: str | None, job_id: str | None) -> bool:
        return (app_id is not None and app_id in self._barred_apps) or job_id in self._barred_jobs

    def stop_for_purge(self, app_id: str, job_ids: Collection[str] | None, timeout_s: float) -> bool:
        """Bars the app's jobs (all, or only ``job_ids``) from the NPU, stops the one running and waits for its thread.

        Nothing the stopped session writes afterwards is registered; the caller deletes its files. Call
        ``release`` with the same arguments when the purge is done.

        Returns:
            True once no barred job is on the worker thread (False after ``timeout_s`` seconds).
        """
        with self._lock:
            if job_ids is None:
                self._barred_apps[app_id] = self._barred_apps.get(app_id, 0) + 1
            else:
                self._barred_jobs.update(job_ids)
            if self._barred(self._current_app, self._current):
                self._target = (JobState.CANCELLED, Blocked.NONE, "data deleted")
                self._stop.set()
                self._wake.set()
            return self._idle.wait_for(lambda: not self._barred(self._current_app, self._current), timeout_s)

    def release(self, app_id: str, job_ids: Collection[str] | None) -> None:
        """Ends a ``stop_for_purge`` bar."""
        with self._lock:
            if job_ids is None:
                left = self._barred_apps.get(app_id, 0) - 1
                if left > 0:
                    self._barred_apps[app_id] = left
                else:
                    self._barred_apps.pop(app_id, None)
            else:
                self._barred_jobs.difference_update(job_ids)
        self.reconcile()

    @property
    def current_job_id(self) -> str | None:
        """The job on the NPU, if any."""
        return self._current

    # -- decisions -------------------------------------------------------------------------------------------------
    def reconcile(self) -> None:
        """Pauses the running job if its conditions lapsed; starts, queues or parks each eligible job in order."""
        with self._lock:
            if self._closing:
                return
            r = self.readings()
            cur = self._current
            if cur is not None and self._target is None:
                job = self._get(cur)
                if job is not None and job.state is JobState.RUNNING:
                    v = self.judge(r, job.spec.requirements)
                    if not v.ok:
                        self._request_stop(cur, JobState.WAITING, v.first, v.explained)
            busy = cur is not None
            for job in self.jobs.in_states(ELIGIBLE):
                if job.blocked is Blocked.OUTSIDE_WINDOW or self._barred(job.app_id, job.job_id):
                    continue
                if job.blocked is Blocked.DISK_FULL:
                    work = self.layout.job_dir(job.app_id, job.job_id)
                    if self.free(work) < disk_needed(work):
                        continue  # still waiting for space: the detail it was given stands
                    if self.reserve is not None:
                        self.reserve.ensure()  # given up when the job stopped: the space is back
                v = self.judge(r, job.spec.requirements)
                if not v.ok:
                    self._move(job.job_id, ELIGIBLE, JobState.WAITING, v.first, v.explained, f"waiting: {v.detail}")
                elif not busy:
                    if self._move(job.job_id, ELIGIBLE, JobState.RUNNING, Blocked.NONE, "", self._start_message(job)):
                        self._current, self._current_app, self._target, busy = job.job_id, job.app_id, None, True
                        self._hook(True)
                        self._stop.clear()
                        self._wake.set()
                else:
                    # Never name the running job: it may be another app's.
                    detail = "another training job is on the NPU; this one runs after it"
                    self._move(job.job_id, ELIGIBLE, JobState.QUEUED, Blocked.NPU_BUSY, detail, "queued behind a job")

    def _hook(self, running: bool) -> None:
        if self.on_running is not None:
            try:
                self.on_running(running)
            except Exception:  # a hook must never stop the queue
                log.exception("running_hook_failed", running=running)

    def _start_message(self, job: Job) -> str:
        if self.backend_for is None:
            return "started"
        try:
            name, reason = self.backend_for(job)
        except Exception as exc:  # a broken probe must not stop scheduling; the session reports the real choice
            log.warning("backend_probe_failed", error=str(exc)[:200])
            return "started (backend not known yet)"
        return f"started on {name}: {reason}"

    def request_pause(self, job_id: str, to: JobState, blocked: Blocked, detail: str) -> bool:
        """Asks the running job to checkpoint and move to ``to``; False if it is not the one running."""
        with self._lock:
            if self._current != job_id:
                return False
            self._request_stop(job_id, to, blocked, detail)
            return True

    def _request_stop(self, job_id: str, to: JobState, blocked: Blocked, detail: str) -> None:
        if self._target is None or to is JobState.CANCELLED or self._closing:
            self._target = (to, blocked, detail)
        if to is not JobState.CANCELLED:
            self._move(job_id, (JobState.RUNNING,), JobState.PAUSING, blocked, detail, f"pausing: {detail}")
        self._stop.set()

    def _move(  # noqa: PLR0917
        self,
        job_id: str,
        allowed: tuple[JobState, ...] | frozenset[JobState],
        to: JobState,
        blocked: Blocked,
        detail: str,
        message: str,
        **fields: Any,
    ) -> bool:
        try:
            job = self.jobs.get(job_id)
            if job.state is to and job.blocked is blocked and job.blocked_detail == detail and not fields:
                return True
            self.jobs.transition(job_id, allowed, to, blocked=blocked, detail=detail, message=message, **fields)
        except (FailedPrecondition, NotFound):
            return False  # changed meanwhile (cancelled, forgotten): the newer decision stands
        self.hub.notify()
        return True

    def _get(self, job_id: str) -> Job | None:
        try:
            return self.jobs.get(job_id)
        except NotFound:
            return None

    # -- the worker ------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            with self._lock:
                job_id = self._current
                if job_id is None and self._closing:
                    return
            if job_id is None:
                continue
            try:
                self._run(job_id)
            except Exception as exc:  # the runner must survive anything a job does
                log.exception("runner_error", job_id=job_id)
                self._fail_after(job_id, exc)
            with self._lock:
                self._current, self._current_app, self._target = None, None, None
                self._stop.clear()
                closing = self._closing
                self._idle.notify_all()
            self._hook(False)
            if closing:
                return
            self.reconcile()

    def _run(self, job_id: str) -> None:
        job = self._get(job_id)
        if job is not None and job.state is JobState.PAUSING:
            # Told to stop (conditions lapsed, a user pause) between being started and this thread taking it up:
            # nothing ran, nothing to checkpoint; finish the pause, or it would stay PAUSING with nobody on it.
            self._paused(job_id)
            return
        if job is None or job.state is not JobState.RUNNING:
            return
        structlog.contextvars.bind_contextvars(job_id=job_id, app_id=job.app_id)
        try:
            samples = self.samples.training_samples(job.app_id, job.spec.dataset_ids, job.data_until_ms)
            work = self.layout.job_dir(job.app_id, job_id)
            work.mkdir(parents=True, exist_ok=True)
            init = None
            if job.spec.init_adapter_id:
                try:
                    init = Path(self.adapters.get(job.app_id, job.spec.init_adapter_id).path)
                except NotFound:
                    self._fail(job_id, "init_adapter_missing", "the adapter the job starts from was deleted")
                    return
            req = SessionRequest(
                job_id, job.app_id, job.spec, tuple(samples), work, self.keep, job.progress.eval_loss_before, init
            )
            log.info("job_running", samples=len(samples), steps=job.spec.params.steps)
            try:
                outcome = self.factory(req).run(self._stop.is_set, _Sink(self, job_id))
            except JobFailure as f:
                if not self._purged(job, work):
                    self._fail(job_id, f.code, scrub_paths(f.message))
                return
            except Exception as exc:
                if self._purged(job, work):
                    return
                if self._out_of_disk(exc, work):
                    self._wait_for_disk(job_id, work, exc)
                    return
                log.exception("job_crashed")
                self._fail(job_id, "internal", f"{type(exc).__name__}: {scrub_paths(str(exc))[:300]}")
                return
            if self._purged(job, work):
                return
            if outcome.completed and outcome.adapter is not None:
                self._succeed(job_id, outcome.adapter)
            else:
                self._paused(job_id)
        finally:
            structlog.contextvars.unbind_contextvars("job_id", "app_id")

    def _purged(self, job: Job, work: Path) -> bool:
        """True if the job's data is being deleted: whatever the session wrote is removed, nothing is recorded."""
        with self._lock:
            barred = self._barred(job.app_id, job.job_id)
        if barred:
            remove_tree(work)
            log.info("job_stopped_for_purge")
        return barred

    def _fail(self, job_id: str, code: str, message: str) -> None:
        log.warning("job_failed", code=code)
        self._move(
            job_id, ON_NPU, JobState.FAILED, Blocked.NONE, "", f"failed: {code}", error_code=code, error_message=message
        )

    def _fail_after(self, job_id: str, exc: Exception) -> None:
        """Ends a job whose run raised outside its session (a store write, a file move): FAILED with the cause, or
        waiting for space when the disk is full (its checkpoints are kept until a result is recorded), never RUNNING
        with no worker on it. If even that cannot be written, the next start queues the job again."""
        job = self._get(job_id)
        try:
            if job is not None and is_disk_full(exc):
                self._wait_for_disk(job_id, self.layout.job_dir(job.app_id, job_id), exc)
            else:
                self._fail(job_id, "internal", f"{type(exc).__name__}: {scrub_paths(str(exc))[:300]}")
        except Exception:
            log.exception("runner_failure_not_recorded", job_id=job_id)

    def _out_of_disk(self, exc: BaseException, work: Path) -> bool:
        """Whether a session's error comes from a full disk: ENOSPC/EDQUOT/SQLITE_FULL, or any error while the job's
        filesystem lacks the room a next attempt needs (torch.save and safetensors report a full disk as their own
        errors: "unexpected pos 704 vs 598", "IoError(... StorageFull ...)")."""
        return is_disk_full(exc) or self.free(work) < disk_needed(work)

    def _wait_for_disk(self, job_id: str, work: Path, exc: BaseException) -> None:
        """The job waits (``Blocked.DISK_FULL``) for the space ``disk_needed`` names, then continues from its last
        checkpoint; a pause or stop asked for meanwhile takes precedence."""
        need = disk_needed(work)
        log.warning("job_waiting_for_disk", error=f"{type(exc).__name__}: {scrub_paths(str(exc))[:200]}",
                    free_bytes=self.free(work), needed_bytes=need)  # fmt: skip
        with self._lock:
            stopping = self._target is not None
        if stopping:
            self._paused(job_id)
            return
        detail = (f"no space left on the device for the job's checkpoints or adapter; it continues from its last "
                  f"checkpoint once {-(-need // (1 << 20))} MiB are free")  # fmt: skip
        try:
            self._move(job_id, ON_NPU, JobState.WAITING, Blocked.DISK_FULL, detail, f"waiting: {detail}")
        except Exception as exc2:
            # Even the job's own state could not be written: the reserve's space takes this one write (else the job
            # would stay RUNNING with no worker on it until the next start).
            if not (is_disk_full(exc2) and self.reserve is not None and self.reserve.release()):
                raise
            self._move(job_id, ON_NPU, JobState.WAITING, Blocked.DISK_FULL, detail, f"waiting: {detail}")

    def _paused(self, job_id: str) -> None:
        with self._lock:
            to, blocked, detail = self._target or (JobState.WAITING, Blocked.NONE, "")
        job = self._get(job_id)
        if job is None:
            return
        if job.state is JobState.CANCELLED:
            self._drop_checkpoints(job)
            return
        step = job.progress.step
        self._move(job_id, ON_NPU, to, blocked, detail, f"paused at step {step} ({detail or to.name})")
        log.info("job_paused", step=step, to=to.value)

    def _discard(self, job_id: str, folder: Path) -> None:
        """The job's adapter is not wanted (it was cancelled or forgotten meanwhile): its folder and checkpoints go."""
        remove_tree(folder)
        job = self._get(job_id)
        if job is not None:
            self._drop_checkpoints(job)

    def _succeed(self, job_id: str, art: AdapterArtifact) -> None:
        job = self._get(job_id)
        if job is None or job.state not in ON_NPU:
            self._discard(job_id, art.path)
            return
        adapter_id = new_id("adp")
        dest = self.layout.adapter_dir(job.app_id, adapter_id)
        dest.mkdir(parents=True, exist_ok=True)
        art.path.replace(dest / "peft")  # same filesystem: an atomic move of the finished folder
        p = job.spec.params
        rec = AdapterRec(
            adapter_id=adapter_id,
            app_id=job.app_id,
            job_id=job_id,
            base_model=art.base_model,
            base_model_sha256=art.base_model_sha256,
            tokenizer_sha256=art.tokenizer_sha256,
            rank=p.rank,
            alpha=p.alpha,
            dropout=p.dropout,
            target_modules=p.targets,
            steps=art.steps,
            eval_loss_before=art.eval_loss_before,
            eval_loss_after=art.eval_loss_after,
            train_loss=art.train_loss,
            precision_plan=art.precision_plan,
            data_until_ms=job.data_until_ms,
            sample_count=art.sample_count,
            created_at_ms=now_ms(),
            size_bytes=tree_size(dest / "peft"),
            path=str(dest / "peft"),
        )
        try:
            self.jobs.succeed(job_id, ON_NPU, rec, f"adapter {adapter_id} ready")
        except (FailedPrecondition, NotFound):  # cancelled or forgotten meanwhile: the newer decision stands
            self._discard(job_id, dest)
            return
        except Exception:  # not committed (a full disk): no record may ever name the folder
            remove_tree(dest)
            raise
        self.hub.notify()
        self._drop_checkpoints(job)
        log.info("job_succeeded", adapter_id=adapter_id, steps=art.steps)

    def _drop_checkpoints(self, job: Job) -> None:
        self.jobs.drop_checkpoints(job.job_id)
        remove_tree(self.layout.job_dir(job.app_id, job.job_id))


# A PHASE event is written when the phase changes, its fraction moved on by this much (planning reports often), or
# this long after the last one. The engine's heartbeat repeats a slow phase's fraction every HEARTBEAT_PERIOD_S; at half
# that, every repeat is written unless an event came in the half period before it, so a listener waits at most 1.5
# periods. At a whole period a repeat that came just under a period after a fraction's event was dropped and the next
# one came a period later: a 2.13 s gap between planning events with two other processes spinning (Zen 5, 2 cores),
# past the 2 s budget.
PHASE_EVENT_STEP = 0.05
PHASE_EVENT_EVERY_S = HEARTBEAT_PERIOD_S / 2


class _Sink:
    """Turns session reports into stored events (called on the worker thread).

    Every report keeps what the job's progress already holds (data summary, loss before training) and sets the
    phase it implies: a finished step is phase TRAINING at step / total_steps.
    """

    def __init__(self, runner: Runner, job_id: str) -> None:
        self.r, self.job_id = runner, job_id
        self._phase_at = 0.0  # monotonic time of the last PHASE event

    def _job(self) -> Job:
        return self.r.jobs.get(self.job_id)

    def _record(self, kind: EventKind, progress: Progress | None = None, message: str = "") -> None:
        self.r.jobs.record(self.job_id, kind, progress=progress, message=message)
        self.r.hub.notify()

    def backend(self, name: str, reason: str) -> None:
        job = self._job()
        if job.state in ON_NPU:
            self.r.jobs.transition(
                self.job_id, ON_NPU, job.state, blocked=job.blocked, detail=job.blocked_detail, backend=name
            )
        self._record(EventKind.NOTICE, message=f"backend {name}: {reason}")

    def eval_before(self, loss: float, total_steps: int) -> None:
        # Stored in the job's progress, so a resumed run (or a restarted daemon) does not measure it again.
        p = replace(self._job().progress, step=0, total_steps=total_steps, eval_loss=loss, eval_loss_before=loss)
        self._record(EventKind.EVAL, p, f"held-out loss before training {loss:.4f}")

    def progress(self, progress: Progress, *, evaluated: bool) -> None:
        cur = self._job().progress
        frac = progress.step / progress.total_steps if progress.total_steps else None
        progress = replace(
            progress,
            eval_loss_before=progress.eval_loss_before
            if progress.eval_loss_before is not None
            else cur.eval_loss_before,
            phase=Phase.TRAINING,
            phase_fraction=frac,
            data=progress.data or cur.data,
        )
        # Every step is a PROGRESS event; a step that ended with an evaluation is followed by its EVAL event.
        self._record(EventKind.PROGRESS, progress)
        if evaluated:
            self._record(EventKind.EVAL, progress)

    def checkpoint(self, step: int, path: Path, size_bytes: int, train_loss: float) -> None:
        known = self.r.jobs.checkpoints(self.job_id)
        if any(c.step == step and c.path == str(path) for c in known):
            return  # recorded when it was written; a resume reports the one it starts from again
        rec = CheckpointRec(new_id("ckpt"), self.job_id, step, now_ms(), size_bytes, train_loss, str(path))
        self.r.jobs.record(self.job_id, EventKind.CHECKPOINT, checkpoint=rec, message=f"checkpoint at step {step}")
        # The trainer keeps only the newest few files; forget records whose file is gone.
        alive = [c.path for c in (*known, rec) if Path(c.path).exists()]
        self.r.jobs.drop_checkpoints(self.job_id, keep_paths=alive)
        self.r.hub.notify()

    def notice(self, message: str) -> None:
        self._record(EventKind.NOTICE, message=message)

    def warning(self, message: str) -> None:
        self._record(EventKind.WARNING, message=message)

    def phase(self, phase: Phase, fraction: float | None) -> None:
        cur = self._job().progress
        now = time.monotonic()
        if cur.phase is phase:
            moved = fraction is not None and (
                cur.phase_fraction is None or abs(fraction - cur.phase_fraction) >= PHASE_EVENT_STEP or fraction >= 1
            )
            if not moved and now - self._phase_at < PHASE_EVENT_EVERY_S:
                return
        self._phase_at = now
        self._record(EventKind.PHASE, replace(cur, phase=phase, phase_fraction=fraction))

    def data(self, summary: DataSummary) -> None:
        rejected = ", ".join(f"{n} {reason}" for reason, n in summary.rejected)
        self._record(
            EventKind.NOTICE,
            replace(self._job().progress, data=summary),
            f"data: {summary.train_samples} train and {summary.eval_samples} held-out samples"
            + (f"; rejected {rejected}" if rejected else ""),
        )
