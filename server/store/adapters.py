"""Each app's adapter registry."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

from lorad.server.errors import NotFound
from lorad.server.records import AdapterRec
from lorad.server.store._codec import dumps
from lorad.server.store.db import Database, decode_int_cursor, encode_cursor, page_size

_COLUMNS = ("adapter_id", "app_id", "job_id", "created_at_ms", "size_bytes", "path")


def _rec(r: sqlite3.Row) -> AdapterRec:
    meta = json.loads(r["meta"])
    meta["target_modules"] = tuple(meta["target_modules"])
    meta["precision_plan"] = tuple(tuple(p) for p in meta["precision_plan"])
    return AdapterRec(**{k: r[k] for k in _COLUMNS}, **meta)


def insert_adapter(c: sqlite3.Connection, rec: AdapterRec) -> None:
    """Inserts the adapter's record inside the caller's transaction (its files are already in place)."""
    meta = {k: v for k, v in dataclasses.asdict(rec).items() if k not in _COLUMNS}
    c.execute(
        "INSERT INTO adapters(adapter_id, app_id, job_id, meta, created_at_ms, size_bytes, path)"
        " VALUES (?,?,?,?,?,?,?)",
        (rec.adapter_id, rec.app_id, rec.job_id, dumps(meta), rec.created_at_ms, rec.size_bytes, rec.path),
    )


class AdapterRepo:
    """Adapter records; files live under the app's directory (see jobs/files.py)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, rec: AdapterRec) -> None:
        """Registers an imported adapter (its files are already in place; a job's adapter: ``JobRepo.succeed``)."""
        with self.db.tx() as c:
            insert_adapter(c, rec)

    def get(self, app_id: str, adapter_id: str) -> AdapterRec:
        """One adapter of the app.

        Raises:
            NotFound: absent or another app's.
        """
        with self.db.read() as c:
            row = c.execute("SELECT * FROM adapters WHERE adapter_id=? AND app_id=?", (adapter_id, app_id)).fetchone()
        if row is None:
            raise NotFound("adapter", adapter_id)
        return _rec(row)

    def list_page(self, app_id: str, size: int, token: str) -> tuple[list[AdapterRec], str]:
        """The app's adapters newest first; returns (page, next_page_token)."""
        before = decode_int_cursor(token, 2**62)
        limit = page_size(size)
        with self.db.read() as c:
            rows = c.execute(
                "SELECT * FROM adapters WHERE app_id=? AND seq < ? ORDER BY seq DESC LIMIT ?",
                (app_id, before, limit + 1),
            ).fetchall()
        nxt = encode_cursor(str(rows[limit - 1]["seq"])) if len(rows) > limit else ""
        return [_rec(r) for r in rows[:limit]], nxt

    def count(self, app_id: str) -> int:
        """How many adapters the app has."""
        with self.db.read() as c:
            return int(c.execute("SELECT COUNT(*) FROM adapters WHERE app_id=?", (app_id,)).fetchone()[0])

    def delete(self, app_id: str, adapter_id: str) -> AdapterRec:
        """Removes the record; returns it so the caller deletes the files.

        Raises:
            NotFound: absent or another app's.
        """
        rec = self.get(app_id, adapter_id)
        with self.db.tx() as c:
            c.execute("DELETE FROM adapters WHERE adapter_id=?", (adapter_id,))
        return rec

    def ids(self, app_id: str) -> set[str]:
        """The app's adapter ids."""
        with self.db.read() as c:
            return {r[0] for r in c.execute("SELECT adapter_id FROM adapters WHERE app_id=?", (app_id,))}

    def all_for_app(self, app_id: str) -> list[AdapterRec]:
        """Every adapter of the app."""
        with self.db.read() as c:
            return [_rec(r) for r in c.execute("SELECT * FROM adapters WHERE app_id=?", (app_id,)).fetchall()]
