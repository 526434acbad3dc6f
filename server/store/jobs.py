"""Jobs, their event history and checkpoints. Every state change writes its event in the same transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterable
from typing import Any

from lorad.server.errors import AlreadyExists, FailedPrecondition, NotFound, ResourceExhausted
from lorad.server.records import (
    ACTIVE_STATES,
    AdapterRec,
    Blocked,
    CheckpointRec,
    EventKind,
    Job,
    JobEvent,
    JobSpec,
    JobState,
    Progress,
)
from lorad.server.store._codec import (
    checkpoint_from_json,
    checkpoint_to_json,
    progress_from_json,
    progress_to_json,
    spec_from_json,
    spec_hash,
    spec_to_json,
)
from lorad.server.store.adapters import insert_adapter
from lorad.server.store.db import (
    Database,
    decode_int_cursor,
    encode_cursor,
    new_id,
    now_ms,
    page_size,
    require_active_app,
)


def _job(r: sqlite3.Row) -> Job:
    return Job(
        job_id=r["job_id"],
        app_id=r["app_id"],
        request_id=r["request_id"],
        spec=spec_from_json(r["spec"]),
        state=JobState(r["state"]),
        blocked=Blocked(r["blocked"]),
        blocked_detail=r["blocked_detail"],
        progress=progress_from_json(r["progress"]),
        error_code=r["error_code"],
        error_message=r["error_message"],
        adapter_id=r["adapter_id"],
        backend=r["backend"],
        schedule_id=r["schedule_id"],
        created_at_ms=r["created_at_ms"],
        started_at_ms=r["started_at_ms"],
        finished_at_ms=r["finished_at_ms"],
        data_until_ms=r["data_until_ms"],
    )


def _event(r: sqlite3.Row) -> JobEvent:
    return JobEvent(
        job_id=r["job_id"],
        event_id=r["event_id"],
        time_ms=r["time_ms"],
        kind=EventKind(r["kind"]),
        state=JobState(r["state"]),
        blocked=Blocked(r["blocked"]),
        progress=progress_from_json(r["progress"]),
        checkpoint=checkpoint_from_json(r["checkpoint"]),
        message=r["message"],
        error_code=r["error_code"],
        error_message=r["error_message"],
    )


def _insert_event(
    c: sqlite3.Connection, job: Job, kind: EventKind, message: str = "", checkpoint: CheckpointRec | None = None
) -> JobEvent:
    cur = c.execute(
        "INSERT INTO job_events(job_id, time_ms, kind, state, blocked, progress, checkpoint, message, error_code,"
        " error_message) VALUES (?,?,?,?,?,?,?,?,?,?)",
        (
            job.job_id,
            now_ms(),
            kind.value,
            job.state.value,
            job.blocked.value,
            progress_to_json(job.progress),
            checkpoint_to_json(checkpoint),
            message,
            job.error_code,
            job.error_message,
        ),
    )
    row = c.execute("SELECT * FROM job_events WHERE event_id=?", (cur.lastrowid,)).fetchone()
    return _event(row)


def _load(c: sqlite3.Connection, job_id: str, app_id: str | None) -> Job:
    row = c.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
    # Another app's job is reported exactly like an absent one.
    if row is None or (app_id is not None and row["app_id"] != app_id):
        raise NotFound("job", job_id)
    return _job(row)


def _transition(  # noqa: PLR0917
    c: sqlite3.Connection,
    job_id: str,
    app_id: str | None,
    allowed_from: Collection[JobState],
    to: JobState,
    blocked: Blocked,
    detail: str,
    message: str,
    fields: dict[str, Any],
) -> tuple[Job, JobEvent | None]:
    job = _load(c, job_id, app_id)
    if job.state not in allowed_from:
        raise FailedPrecondition(
            f"job {job_id} is {job.state.name}; this needs one of {', '.join(sorted(s.name for s in allowed_from))}"
        )
    if to.final:
        fields.setdefault("finished_at_ms", now_ms())
    if to is JobState.RUNNING and not job.started_at_ms:
        fields.setdefault("started_at_ms", now_ms())
    same = job.state is to and job.blocked is blocked
    cols = {"state": to.value, "blocked": blocked.value, "blocked_detail": detail, **fields}
    c.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in cols)} WHERE job_id=?", (*cols.values(), job_id))
    job = _load(c, job_id, None)
    return job, None if same else _insert_event(c, job, EventKind.STATE_CHANGED, message)


class JobRepo:
    """Job records. ``app_id=None`` in a lookup means the daemon itself (no app scoping)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(  # noqa: PLR0917
        self,
        app_id: str,
        request_id: str,
        spec: JobSpec,
        state: JobState,
        blocked: Blocked,
        max_active: int,
        schedule_id: str = "",
        max_adapters: int | None = None,
    ) -> tuple[Job, bool]:
        """Creates a job, or returns the existing one for a retried request_id with the same spec.

        Returns:
            (job, created): created is False for an idempotent retry.

        Raises:
            AlreadyExists: request_id reused with a different spec.
            ResourceExhausted: the app has ``max_active`` jobs that are not final.
        """
        h = spec_hash(spec)
        with self.db.tx() as c:
            row = c.execute("SELECT * FROM jobs WHERE app_id=? AND request_id=?", (app_id, request_id)).fetchone()
            if row is not None:
                if row["spec_hash"] != h:
                    raise AlreadyExists(
                        f"request_id {request_id!r} was used for job {row['job_id']} with a different payload; "
                        "use a new request_id for a new job"
                    )
                return _job(row), False
            require_active_app(c, app_id)
            marks = ",".join("?" * len(ACTIVE_STATES))
            (active,) = c.execute(
                f"SELECT COUNT(*) FROM jobs WHERE app_id=? AND state IN ({marks})",
                (app_id, *[s.value for s in ACTIVE_STATES]),
            ).fetchone()
            if active >= max_active:
                raise ResourceExhausted(
                    f"job quota: {active} active jobs >= max_active_jobs={max_active}; cancel one or wait for one "
                    "to finish"
                )
            if max_adapters is not None:  # each active job will register one adapter
                (adapters,) = c.execute("SELECT COUNT(*) FROM adapters WHERE app_id=?", (app_id,)).fetchone()
                if adapters + active >= max_adapters:
                    raise ResourceExhausted(
                        f"adapter quota: {adapters} adapters + {active} active jobs >= max_adapters={max_adapters}; "
                        "delete an adapter first"
                    )
            ts = now_ms()
            job_id = new_id("job")
            c.execute(
                "INSERT INTO jobs(job_id, app_id, request_id, spec_hash, spec, state, blocked, schedule_id,"
                " created_at_ms, data_until_ms) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (job_id, app_id, request_id, h, spec_to_json(spec), state.value, blocked.value, schedule_id, ts, ts),
            )
            job = _load(c, job_id, None)
            _insert_event(c, job, EventKind.STATE_CHANGED, f"job created in {state.name}")
        return job, True

    def find_request(self, app_id: str, request_id: str, spec: JobSpec) -> Job | None:
        """The job an earlier CreateJob with this request_id made, or None.

        Raises:
            AlreadyExists: request_id reused with a different spec.
        """
        with self.db.read() as c:
            row = c.execute("SELECT * FROM jobs WHERE app_id=? AND request_id=?", (app_id, request_id)).fetchone()
        if row is None:
            return None
        if row["spec_hash"] != spec_hash(spec):
            raise AlreadyExists(
                f"request_id {request_id!r} was used for job {row['job_id']} with a different "
                "payload; use a new request_id for a new job"
            )
        return _job(row)

    def get(self, job_id: str, app_id: str | None = None) -> Job:
        """One job (scoped to ``app_id`` unless None).

        Raises:
            NotFound: absent or another app's.
        """
        with self.db.read() as c:
            return _load(c, job_id, app_id)

    def list_page(self, app_id: str, states: Collection[JobState], size: int, token: str) -> tuple[list[Job], str]:
        """The app's jobs newest first; returns (page, next_page_token)."""
        before = decode_int_cursor(token, 2**62)
        limit = page_size(size)
        sql = "SELECT * FROM jobs WHERE app_id=? AND seq < ?"
        args: list[Any] = [app_id, before]
        if states:
            sql += f" AND state IN ({','.join('?' * len(states))})"
            args += [s.value for s in states]
        with self.db.read() as c:
            rows = c.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        nxt = encode_cursor(str(rows[limit - 1]["seq"])) if len(rows) > limit else ""
        return [_job(r) for r in rows[:limit]], nxt

    def in_states(self, states: Iterable[JobState]) -> list[Job]:
        """Every job (all apps) in one of ``states``, in creation (queue) order."""
        st = [s.value for s in states]
        with self.db.read() as c:
            rows = c.execute(f"SELECT * FROM jobs WHERE state IN ({','.join('?' * len(st))}) ORDER BY seq", st)
            return [_job(r) for r in rows.fetchall()]

    def transition(
        self,
        job_id: str,
        allowed_from: Collection[JobState],
        to: JobState,
        *,
        app_id: str | None = None,
        blocked: Blocked = Blocked.NONE,
        detail: str = "",
        message: str = "",
        **fields: Any,
    ) -> tuple[Job, JobEvent | None]:
        """Moves a job to ``to`` if its state is in ``allowed_from``, writing a STATE_CHANGED event.

        A change of only the blocked reason/detail (same state) is written without a new event unless the reason
        changed. ``fields`` sets other columns (error_code, error_message, adapter_id, backend, started_at_ms…).

        Raises:
            NotFound: absent or another app's.
            FailedPrecondition: the current state is not in ``allowed_from`` (the message names it).
        """
        with self.db.tx() as c:
            return _transition(c, job_id, app_id, allowed_from, to, blocked, detail, message, fields)

    def succeed(self, job_id: str, allowed_from: Collection[JobState], adapter: AdapterRec, message: str) -> Job:
        """Registers the job's finished adapter and moves the job to SUCCEEDED in one transaction.

        A kill leaves both or neither: never a listed adapter next to a job that resumes training and makes another.

        Raises:
            NotFound: the job is gone.
            FailedPrecondition: the job's state is not in ``allowed_from`` (nothing is registered).
        """
        with self.db.tx() as c:
            job, _ = _transition(c, job_id, None, allowed_from, JobState.SUCCEEDED, Blocked.NONE, "", message,
                                 {"adapter_id": adapter.adapter_id})  # fmt: skip
            insert_adapter(c, adapter)
        return job

    def record(
        self,
        job_id: str,
        kind: EventKind,
        *,
        progress: Progress | None = None,
        message: str = "",
        checkpoint: CheckpointRec | None = None,
    ) -> tuple[Job, JobEvent]:
        """Appends a PROGRESS / EVAL / CHECKPOINT / NOTICE event (and stores the new progress)."""
        with self.db.tx() as c:
            if progress is not None:
                c.execute("UPDATE jobs SET progress=? WHERE job_id=?", (progress_to_json(progress), job_id))
            if checkpoint is not None:
                c.execute(
                    "INSERT INTO checkpoints(checkpoint_id, job_id, step, created_at_ms, size_bytes, train_loss, path)"
                    " VALUES (?,?,?,?,?,?,?)",
                    (
                        checkpoint.checkpoint_id,
                        job_id,
                        checkpoint.step,
                        checkpoint.created_at_ms,
                        checkpoint.size_bytes,
                        checkpoint.train_loss,
                        checkpoint.path,
                    ),
                )
            job = _load(c, job_id, None)
            return job, _insert_event(c, job, kind, message, checkpoint)

    def events(self, job_id: str, after_event_id: int, limit: int) -> tuple[list[JobEvent], bool]:
        """Events after ``after_event_id`` (at most ``limit``), oldest first; returns (events, has_more)."""
        with self.db.read() as c:
            rows = c.execute(
                "SELECT * FROM job_events WHERE job_id=? AND event_id > ? ORDER BY event_id LIMIT ?",
                (job_id, after_event_id, limit + 1),
            ).fetchall()
        return [_event(r) for r in rows[:limit]], len(rows) > limit

    def checkpoints(self, job_id: str) -> list[CheckpointRec]:
        """The job's checkpoint records ordered by step."""
        with self.db.read() as c:
            rows = c.execute("SELECT * FROM checkpoints WHERE job_id=? ORDER BY step", (job_id,)).fetchall()
        return [CheckpointRec(**{k: r[k] for k in r.keys()}) for r in rows]  # noqa: SIM118

    def drop_checkpoints(self, job_id: str, keep_paths: Collection[str] = ()) -> list[CheckpointRec]:
        """Deletes checkpoint records whose path is not in ``keep_paths``; returns the deleted ones."""
        gone = [c for c in self.checkpoints(job_id) if c.path not in keep_paths]
        with self.db.tx() as c:
            c.executemany("DELETE FROM checkpoints WHERE checkpoint_id=?", [(g.checkpoint_id,) for g in gone])
        return gone

    def all_ids(self, app_id: str) -> list[str]:
        """Every job id of the app (any state)."""
        with self.db.read() as c:
            return [r["job_id"] for r in c.execute("SELECT job_id FROM jobs WHERE app_id=?", (app_id,)).fetchall()]

    def of_app(self, app_id: str) -> list[Job]:
        """Every job of the app (any state), oldest first."""
        with self.db.read() as c:
            rows = c.execute("SELECT * FROM jobs WHERE app_id=? ORDER BY seq", (app_id,)).fetchall()
        return list(map(_job, rows))
