"""Job operations behind the JobService: create (idempotent), control (pause/resume/cancel) and observe."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import structlog

from lorad.server.errors import FailedPrecondition, NotFound
from lorad.server.gate import DeletionGate, Write
from lorad.server.jobs.files import Layout, remove_tree
from lorad.server.jobs.hub import EventHub
from lorad.server.jobs.runner import Runner
from lorad.server.records import ACTIVE_STATES, Blocked, CheckpointRec, Job, JobEvent, JobSpec, JobState
from lorad.server.store import AdapterRepo, AppRepo, JobRepo, SampleRepo
from lorad.server.store.db import page_size

log = structlog.get_logger(__name__)

PAUSABLE = (JobState.QUEUED, JobState.WAITING)


class JobManager:
    """Job operations scoped to one app per call; the runner does the NPU side."""

    def __init__(  # noqa: PLR0917
        self,
        apps: AppRepo,
        jobs: JobRepo,
        samples: SampleRepo,
        adapters: AdapterRepo,
        runner: Runner,
        hub: EventHub,
        layout: Layout,
        gate: DeletionGate,
    ) -> None:
        self.apps, self.jobs, self.samples, self.adapters = apps, jobs, samples, adapters
        self.runner, self.hub, self.layout, self.gate = runner, hub, layout, gate
        self.on_window: list = []  # callbacks(job) registering a job's window with the scheduler

    def create(self, app_id: str, request_id: str, spec: JobSpec, schedule_id: str = "") -> Job:
        """Creates a job (or returns the one a retried request_id made).

        Raises:
            NotFound: a dataset or the init adapter is absent or another app's.
            AlreadyExists: request_id reused with a different payload.
            ResourceExhausted: active-job or adapter quota.
            Aborted: a deletion of one of the app's datasets or adapters, or of all its data, is running.
        """
        retried = self.jobs.find_request(app_id, request_id, spec)  # a retry is answered before any check
        if retried is not None:
            return retried
        with self.adding(app_id, spec):
            quota = self.apps.get(app_id).quota
            state, blocked = (
                (JobState.QUEUED, Blocked.OUTSIDE_WINDOW) if spec.window else (JobState.WAITING, Blocked.NONE)
            )
            job, created = self.jobs.create(
                app_id,
                request_id,
                spec,
                state,
                blocked,
                quota.max_active_jobs,
                schedule_id,
                max_adapters=quota.max_adapters,
            )
            if created and spec.window:  # before a deletion may start: it removes the windows of the jobs it finds
                for cb in self.on_window:
                    cb(job)
        if created:
            log.info("job_created", job_id=job.job_id, app_id=app_id, windowed=spec.window is not None)
            self.hub.notify()
            if not spec.window:
                self.runner.reconcile()
            with contextlib.suppress(NotFound):  # a ForgetApp right after: the job as created is the answer
                job = self.jobs.get(job.job_id)
        return job

    @contextmanager
    def adding(self, app_id: str, spec: JobSpec) -> Iterator[None]:
        """Stores a job or schedule inside: what it reads is there (its datasets, and its init adapter, checked when
        the request arrived but maybe deleted since) and no deletion of it starts until the block ends.

        Raises:
            NotFound: a dataset or the init adapter is absent or another app's.
            Aborted: a deletion of one of them, or of all the app's data, is running.
        """
        with self.gate.writing(app_id, Write.JOB, spec.dataset_ids, adapter_id=spec.init_adapter_id):
            self._require_inputs(app_id, spec)
            yield

    def _require_inputs(self, app_id: str, spec: JobSpec) -> None:
        have = self.samples.existing_datasets(app_id, spec.dataset_ids)
        for d in spec.dataset_ids:
            if d not in have:
                raise NotFound("dataset", d)
        if spec.init_adapter_id:
            self.adapters.get(app_id, spec.init_adapter_id)

    def get(self, app_id: str, job_id: str) -> Job:
        """One of the app's jobs (NotFound for absent and not-yours alike)."""
        return self.jobs.get(job_id, app_id)

    def list_page(self, app_id: str, states: Collection[JobState], size: int, token: str) -> tuple[list[Job], str]:
        """The app's jobs, newest first."""
        return self.jobs.list_page(app_id, states, size, token)

    def pause(self, app_id: str, job_id: str) -> Job:
        """RUNNING → PAUSING → PAUSED (checkpoint); QUEUED/WAITING → PAUSED; PAUSING/PAUSED unchanged.

        Raises:
            FailedPrecondition: the job is final (the message names its state).
        """
        job = self.jobs.get(job_id, app_id)
        detail = f"paused by the user; continue with `lorad jobs resume {job_id}`"
        if job.state is JobState.RUNNING:
            if not self.runner.request_pause(job_id, JobState.PAUSED, Blocked.PAUSED_BY_USER, detail):
                raise FailedPrecondition(f"job {job_id} is RUNNING but not on the NPU yet; retry")
        elif job.state in PAUSABLE:
            self.jobs.transition(
                job_id,
                PAUSABLE,
                JobState.PAUSED,
                app_id=app_id,
                blocked=Blocked.PAUSED_BY_USER,
                detail=detail,
                message="paused by the user",
            )
            self.hub.notify()
            self.runner.reconcile()
        elif job.state is JobState.PAUSING and job.blocked is not Blocked.PAUSED_BY_USER:
            # Pausing for the device conditions: make it a user pause so it does not resume on its own.
            self.runner.request_pause(job_id, JobState.PAUSED, Blocked.PAUSED_BY_USER, detail)
        elif job.state.final:
            raise FailedPrecondition(f"job {job_id} is {job.state.name}; only a job that is not final can be paused")
        return self.jobs.get(job_id)

    def resume(self, app_id: str, job_id: str) -> Job:
        """PAUSED → WAITING (it runs when the conditions hold and the NPU is free).

        Raises:
            FailedPrecondition: the job is not PAUSED (the message names its state).
        """
        job = self.jobs.get(job_id, app_id)
        if job.state is not JobState.PAUSED:
            raise FailedPrecondition(f"job {job_id} is {job.state.name}; only a PAUSED job can be resumed")
        self.jobs.transition(job_id, (JobState.PAUSED,), JobState.WAITING, app_id=app_id, message="resumed")
        self.hub.notify()
        self.runner.reconcile()
        return self.jobs.get(job_id)

    def cancel(self, app_id: str, job_id: str, message: str = "cancelled") -> Job:
        """Any non-final state → CANCELLED; checkpoints are deleted (a running job stops at its next step).

        Raises:
            FailedPrecondition: the job is already final (the message names its state).
        """
        job = self.jobs.get(job_id, app_id)
        if job.state.final:
            raise FailedPrecondition(f"job {job_id} is {job.state.name}; only a job that is not final can be cancelled")
        job, _ = self.jobs.transition(job_id, ACTIVE_STATES, JobState.CANCELLED, app_id=app_id, message=message)
        self.hub.notify()
        if not self.runner.request_pause(job_id, JobState.CANCELLED, Blocked.NONE, "cancelled"):
            self.jobs.drop_checkpoints(job_id)
            remove_tree(self.layout.job_dir(app_id, job_id))
        self.runner.reconcile()
        return job

    def events(self, app_id: str, job_id: str, after_event_id: int, size: int) -> tuple[list[JobEvent], bool]:
        """A page of the job's events after ``after_event_id``."""
        self.jobs.get(job_id, app_id)
        return self.jobs.events(job_id, after_event_id, page_size(size))

    def checkpoints(self, app_id: str, job_id: str) -> list[CheckpointRec]:
        """The job's checkpoints ordered by step."""
        self.jobs.get(job_id, app_id)
        return self.jobs.checkpoints(job_id)

    def open_window(self, job_id: str) -> None:
        """The job's window opened: QUEUED(outside window) → WAITING, then let the runner decide."""
        try:
            job = self.jobs.get(job_id)
        except NotFound:
            return
        if job.state is JobState.QUEUED and job.blocked is Blocked.OUTSIDE_WINDOW:
            self.jobs.transition(job_id, (JobState.QUEUED,), JobState.WAITING, message="training window opened")
            self.hub.notify()
        self.runner.reconcile()

    def cancel_all(self, app_id: str) -> int:
        """Cancels every active job of the app (ForgetApp); returns how many."""
        n = 0
        for job in self.jobs.list_page(app_id, ACTIVE_STATES, 1000, "")[0]:
            try:
                self.cancel(app_id, job.job_id)
                n += 1
            except FailedPrecondition:
                pass
        return n
