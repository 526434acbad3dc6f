"""Deletes an app's or a dataset's rows in small transactions that also succeed on a full disk."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TypeVar

import structlog

from lorad.server.errors import ResourceExhausted
from lorad.server.store.db import Database

log = structlog.get_logger(__name__)

T = TypeVar("T")
BATCH_BYTES = 1 << 20  # sample bytes deleted per transaction: secure_delete writes each freed page to the WAL
BATCH_ROWS = 500


def is_disk_full(exc: BaseException) -> bool:
    """SQLITE_FULL or ENOSPC/EDQUOT."""
    if isinstance(exc, sqlite3.OperationalError):
        return "full" in str(exc).lower()
    return isinstance(exc, OSError) and exc.errno in (28, 122)


class Purger:
    """Row deletion for ForgetApp / DeleteDataset. ``free_space()`` is called once when the disk is full."""

    def __init__(self, db: Database, free_space: Callable[[], bool]) -> None:
        self.db = db
        self.free_space = free_space
        self.tight = False  # the disk was full: truncate the WAL after every batch so its space is reused

    def write(self, fn: Callable[[], T]) -> T:
        """Runs one write; on a full disk frees the reserve, truncates the WAL and tries again once."""
        try:
            out = fn()
        except (sqlite3.OperationalError, OSError) as exc:
            if not is_disk_full(exc):
                raise
            log.warning("purge_disk_full")
            self.tight = True
            self.free_space()
            try:
                self.db.checkpoint_truncate()
                out = fn()
            except (sqlite3.OperationalError, OSError) as exc2:
                if not is_disk_full(exc2):
                    raise
                raise ResourceExhausted(
                    "no space left on the device even for deleting; free some space outside lorad and retry "
                    "(the deletion is recorded and finishes at the next start)"
                ) from None
        if self.tight:
            self.db.checkpoint_truncate()
        return out

    def _batch(self, where: str, args: tuple) -> int:
        with self.db.tx() as c:
            rows = c.execute(
                f"SELECT seq, size_bytes FROM samples WHERE {where} ORDER BY seq LIMIT ?", (*args, BATCH_ROWS)
            ).fetchall()
            seqs: list[int] = []
            total = 0
            for r in rows:
                if seqs and total + r["size_bytes"] > BATCH_BYTES:
                    break
                seqs.append(r["seq"])
                total += r["size_bytes"]
            c.executemany("DELETE FROM samples WHERE seq=?", [(s,) for s in seqs])
        return len(seqs)

    def samples(self, app_id: str, dataset_id: str | None = None) -> int:
        """Deletes the app's samples (of one dataset, if given) batch by batch; returns how many."""
        where, args = (
            ("app_id=?", (app_id,)) if dataset_id is None else ("app_id=? AND dataset_id=?", (app_id, dataset_id))
        )
        n = 0
        while k := self.write(lambda: self._batch(where, args)):
            n += k
        return n

    def job_rows(self, job_ids: list[str]) -> None:
        """Deletes the jobs' events and checkpoint records (in batches), then the jobs."""
        for job_id in job_ids:

            def events(job_id: str = job_id) -> int:
                with self.db.tx() as c:
                    return int(
                        c.execute(
                            "DELETE FROM job_events WHERE event_id IN (SELECT event_id FROM job_events"
                            " WHERE job_id=? LIMIT 2000)",
                            (job_id,),
                        ).rowcount
                    )

            while self.write(events):
                pass

            def rest(job_id: str = job_id) -> None:
                with self.db.tx() as c:
                    c.execute("DELETE FROM checkpoints WHERE job_id=?", (job_id,))
                    c.execute("DELETE FROM jobs WHERE job_id=?", (job_id,))

            self.write(rest)

    def execute(self, sql: str, args: tuple) -> int:
        """One small deletion statement in its own transaction; returns the row count."""

        def run() -> int:
            with self.db.tx() as c:
                return int(c.execute(sql, args).rowcount)

        return self.write(run)

    def finish(self) -> None:
        """Drops the WAL's old page images (they may still hold deleted rows)."""
        try:
            self.db.checkpoint_truncate()
        except sqlite3.OperationalError as exc:
            log.warning("purge_checkpoint_failed", error=str(exc)[:100])
