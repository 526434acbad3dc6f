"""Recurring schedules (the APScheduler job store holds their triggers; this table holds their specs)."""

from __future__ import annotations

from lorad.server.errors import NotFound, ResourceExhausted
from lorad.server.records import JobSpec, Schedule
from lorad.server.store._codec import spec_from_json, spec_to_json
from lorad.server.store.db import Database, new_id, now_ms

MAX_PER_APP = 16  # each one fires a job; more than a few per app is a runaway client


class ScheduleRepo:
    """Schedules table access, scoped per app."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, app_id: str, spec: JobSpec) -> Schedule:
        """Stores a new schedule.

        Raises:
            ResourceExhausted: the app has MAX_PER_APP schedules already.
        """
        s = Schedule(new_id("sch"), app_id, spec, now_ms())
        with self.db.tx() as c:
            (n,) = c.execute("SELECT COUNT(*) FROM schedules WHERE app_id=?", (app_id,)).fetchone()
            if n >= MAX_PER_APP:
                raise ResourceExhausted(f"schedule quota: {n} schedules >= {MAX_PER_APP} per app; delete one first")
            c.execute(
                "INSERT INTO schedules(schedule_id, app_id, spec, created_at_ms) VALUES (?,?,?,?)",
                (s.schedule_id, app_id, spec_to_json(spec), s.created_at_ms),
            )
        return s

    def for_app(self, app_id: str | None) -> list[Schedule]:
        """The app's schedules (every schedule for None), oldest first."""
        with self.db.read() as c:
            if app_id is None:
                rows = c.execute("SELECT * FROM schedules ORDER BY created_at_ms").fetchall()
            else:
                rows = c.execute("SELECT * FROM schedules WHERE app_id=? ORDER BY created_at_ms", (app_id,)).fetchall()
        return [Schedule(r["schedule_id"], r["app_id"], spec_from_json(r["spec"]), r["created_at_ms"]) for r in rows]

    def get(self, schedule_id: str, app_id: str | None = None) -> Schedule:
        """One schedule (NotFound for absent and not-yours alike)."""
        for s in self.for_app(app_id):
            if s.schedule_id == schedule_id:
                return s
        raise NotFound("schedule", schedule_id)

    def delete(self, schedule_id: str, app_id: str | None = None) -> None:
        """Deletes a schedule (NotFound for absent and not-yours alike)."""
        self.get(schedule_id, app_id)
        with self.db.tx() as c:
            c.execute("DELETE FROM schedules WHERE schedule_id=?", (schedule_id,))

    def delete_app(self, app_id: str) -> list[str]:
        """Deletes all of the app's schedules; returns their ids."""
        ids = [s.schedule_id for s in self.for_app(app_id)]
        with self.db.tx() as c:
            c.execute("DELETE FROM schedules WHERE app_id=?", (app_id,))
        return ids
