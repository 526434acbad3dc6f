"""Cron windows: a job's window opens it for the runner; a schedule's window creates a job. Firing only queues work.

APScheduler 3.x (4.0 is alpha) with an SQLAlchemy job store on SQLite so windows survive restarts; fixed job ids
(``window:<job_id>``, ``schedule:<schedule_id>``) make re-registration idempotent; ``coalesce`` turns several missed
firings into one; a misfire grace of hours means a phone asleep at 02:30 still trains that night when it wakes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zoneinfo
from datetime import datetime
from typing import Any

import structlog
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.cron import CronTrigger

from lorad.server.errors import Aborted, LoradError, NotFound
from lorad.server.jobs.manager import JobManager
from lorad.server.records import Job, JobSpec, Schedule, Window
from lorad.server.store.schedules import ScheduleRepo

log = structlog.get_logger(__name__)

FIRE_RETRY_S = 1.0  # a schedule firing while a deletion of what it reads runs asks again this often…
FIRE_PATIENCE_S = 600.0  # …this long (a deletion stops a job and purges rows: seconds, rarely minutes)

_active: WindowScheduler | None = None  # the job store pickles a textual reference to `fire`, not the instance


def fire(kind: str, ident: str) -> None:
    """Entry point the job store calls (module-level so it can be referenced by name)."""
    if _active is not None:
        _active.on_fire(kind, ident)


def trigger_for(w: Window, default_tz: str) -> CronTrigger:
    """The cron trigger of a window with its jitter (seconds)."""
    tz = w.timezone or default_tz or None
    trig = CronTrigger.from_crontab(w.cron, timezone=zoneinfo.ZoneInfo(tz) if tz else None)
    trig.jitter = w.jitter_seconds or None
    return trig


class WindowScheduler:
    """Owns the AsyncIOScheduler; registers job windows and schedules; turns firings into manager calls."""

    def __init__(
        self, db_url: str, manager: JobManager, schedules: ScheduleRepo, misfire_grace_hours: float, timezone: str = ""
    ) -> None:
        self.manager, self.schedules, self.timezone = manager, schedules, timezone
        self.grace_s = int(misfire_grace_hours * 3600)
        self.aps = AsyncIOScheduler(
            jobstores={"default": SQLAlchemyJobStore(url=db_url)},
            job_defaults={"coalesce": True, "misfire_grace_time": self.grace_s, "max_instances": 1},
            timezone=zoneinfo.ZoneInfo(timezone) if timezone else None,
        )
        manager.on_window.append(self.add_job_window)

    def start(self) -> None:
        """Starts firing (inside the running event loop)."""
        global _active
        _active = self
        self.aps.start()

    def shutdown(self) -> None:
        """Stops firing; the job store keeps every window for the next start."""
        global _active
        if self.aps.running:
            self.aps.shutdown(wait=False)
        _active = None

    def _add(self, aps_id: str, kind: str, ident: str, w: Window) -> None:
        self.aps.add_job(
            fire,
            trigger_for(w, self.timezone),
            args=(kind, ident),
            id=aps_id,
            replace_existing=True,
            coalesce=True,
            misfire_grace_time=self.grace_s,
        )

    def add_job_window(self, job: Job) -> None:
        """A job waits for its window: it opens once, at the next firing."""
        if job.spec.window is not None:
            self._add(f"window:{job.job_id}", "job", job.job_id, job.spec.window)

    def add_schedule(self, app_id: str, spec: JobSpec) -> Schedule:
        """Stores a schedule and registers its window."""
        s = self.schedules.add(app_id, spec)
        assert spec.window is not None
        self._add(f"schedule:{s.schedule_id}", "schedule", s.schedule_id, spec.window)
        return self.with_next_run(s)

    def delete_schedule(self, app_id: str | None, schedule_id: str) -> None:
        """Deletes a schedule and its window (jobs it created stay)."""
        self.schedules.delete(schedule_id, app_id)
        self.remove(f"schedule:{schedule_id}")

    def remove(self, aps_id: str) -> None:
        """Removes a registered window if present."""
        if self.aps.get_job(aps_id) is not None:
            self.aps.remove_job(aps_id)

    def list_schedules(self, app_id: str) -> list[Schedule]:
        """The app's schedules, each with its next firing time."""
        return [self.with_next_run(s) for s in self.schedules.for_app(app_id)]

    def with_next_run(self, s: Schedule) -> Schedule:
        """The schedule with its next firing time filled in."""
        j = self.aps.get_job(f"schedule:{s.schedule_id}")
        nxt: datetime | None = getattr(j, "next_run_time", None)
        return dataclasses.replace(s, next_run_at_ms=int(nxt.timestamp() * 1000) if nxt else 0)

    def next_run(self, aps_id: str) -> datetime | None:
        """When a registered window fires next (None if not registered)."""
        j = self.aps.get_job(aps_id)
        return getattr(j, "next_run_time", None)

    def on_fire(self, kind: str, ident: str) -> None:
        """A window opened (runs on APScheduler's executor thread)."""
        try:
            if kind == "job":
                self.remove(f"window:{ident}")
                self.manager.open_window(ident)
                log.info("window_opened", job_id=ident)
            elif kind == "schedule":
                stamp = datetime.now().strftime("%Y%m%dT%H%M")  # one request id for the firing, however often tried
                self._fire_schedule(ident, stamp, time.monotonic() + FIRE_PATIENCE_S)
        except LoradError as exc:  # e.g. quota reached or dataset deleted: skip this night, keep the schedule
            log.warning("window_fire_skipped", kind=kind, id=ident, error=str(exc)[:200])

    def _fire_schedule(self, ident: str, stamp: str, deadline: float) -> None:
        try:
            s = self.schedules.get(ident)
        except NotFound:  # deleted while its window stayed registered (a crash mid-ForgetApp, a deletion just now)
            self.remove(f"schedule:{ident}")
            return
        spec = dataclasses.replace(s.spec, window=None)
        try:
            job = self.manager.create(s.app_id, f"schedule:{ident}:{stamp}", spec, schedule_id=ident)
        except Aborted:
            # A deletion of what the schedule reads is running (and may delete the schedule too): ask again once it
            # ended, from a timer thread of its own: sleeping here would hold a thread of the pool the RPCs run on.
            if time.monotonic() > deadline or not self.aps.running:
                raise
            log.info("schedule_fire_deferred", schedule_id=ident, retry_s=FIRE_RETRY_S)
            retry = threading.Timer(FIRE_RETRY_S, self._retry_fire, (ident, stamp, deadline))
            retry.daemon = True
            retry.start()
            return
        log.info("schedule_fired", schedule_id=ident, job_id=job.job_id, app_id=s.app_id)

    def _retry_fire(self, ident: str, stamp: str, deadline: float) -> None:
        if not self.aps.running:  # the daemon is stopping: this firing is dropped, like any fired during a stop
            log.warning("window_fire_skipped", kind="schedule", id=ident, error="the daemon stopped")
            return
        try:
            self._fire_schedule(ident, stamp, deadline)
        except LoradError as exc:
            log.warning("window_fire_skipped", kind="schedule", id=ident, error=str(exc)[:200])


def describe(aps: Any) -> list[dict[str, Any]]:
    """Registered windows (for tests and debugging)."""
    return [
        {"id": j.id, "next": j.next_run_time, "coalesce": j.coalesce, "grace": j.misfire_grace_time}
        for j in aps.get_jobs()
    ]
