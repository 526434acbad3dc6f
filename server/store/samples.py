"""Datasets and samples: atomic appends with duplicate detection and quotas."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from lorad.server.errors import InvalidArgument, NotFound, ResourceExhausted
from lorad.server.records import AppendResult, Dataset, Quota, SampleBody, StoredSample
from lorad.server.store._codec import body_from_json, body_to_json, content_hash
from lorad.server.store.db import (
    Database,
    decode_cursor,
    decode_int_cursor,
    encode_cursor,
    new_id,
    now_ms,
    page_size,
    require_active_app,
)


def _dataset(c: sqlite3.Connection, app_id: str, dataset_id: str) -> Dataset:
    row = c.execute("SELECT * FROM datasets WHERE app_id=? AND dataset_id=?", (app_id, dataset_id)).fetchone()
    if row is None:
        raise NotFound("dataset", dataset_id)
    n, size = c.execute(
        "SELECT COUNT(*), COALESCE(SUM(size_bytes),0) FROM samples WHERE app_id=? AND dataset_id=?",
        (app_id, dataset_id),
    ).fetchone()
    return Dataset(dataset_id, n, size, row["created_at_ms"], row["updated_at_ms"])


class SampleRepo:
    """Samples and datasets of every app (each method is scoped to one app)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def append(self, app_id: str, dataset_id: str, bodies: Sequence[SampleBody], quota: Quota) -> AppendResult:
        """Stores ``bodies`` in one transaction (all or none); equal bodies already present are duplicates.

        Returns only after COMMIT (synchronous=FULL), so an acknowledged sample survives a crash.

        Raises:
            ResourceExhausted: the app's sample count or byte quota would be exceeded.
        """
        ts = now_ms()
        with self.db.tx() as c:
            require_active_app(c, app_id)
            hashes = [content_hash(b) for b in bodies]
            existing: dict[str, str] = {}
            for h in set(hashes):
                row = c.execute(
                    "SELECT sample_id FROM samples WHERE app_id=? AND dataset_id=? AND content_hash=?",
                    (app_id, dataset_id, h),
                ).fetchone()
                if row is not None:
                    existing[h] = row["sample_id"]
            new: list[tuple[str, str, SampleBody]] = []  # (id, hash, body), first occurrence in the request only
            ids: list[str] = []
            dups = 0
            for h, b in zip(hashes, bodies, strict=True):
                if h in existing:
                    ids.append(existing[h])
                    dups += 1
                    continue
                sid = new_id("smp")
                existing[h] = sid
                new.append((sid, h, b))
                ids.append(sid)
            n, size = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(size_bytes),0) FROM samples WHERE app_id=?", (app_id,)
            ).fetchone()
            add_bytes = sum(b.size_bytes for _, _, b in new)
            if n + len(new) > quota.max_samples:
                raise ResourceExhausted(
                    f"sample quota: {n} stored + {len(new)} new > max_samples={quota.max_samples}; "
                    "delete a dataset or ask the device owner for a larger quota"
                )
            if size + add_bytes > quota.max_sample_bytes:
                raise ResourceExhausted(
                    f"sample byte quota: {size} stored + {add_bytes} new bytes > max_sample_bytes="
                    f"{quota.max_sample_bytes}; delete a dataset or ask the device owner for a larger quota"
                )
            c.execute(
                "INSERT INTO datasets(app_id, dataset_id, created_at_ms, updated_at_ms) VALUES (?,?,?,?)"
                " ON CONFLICT(app_id, dataset_id) DO UPDATE SET updated_at_ms=excluded.updated_at_ms",
                (app_id, dataset_id, ts, ts),
            )
            c.executemany(
                "INSERT INTO samples(sample_id, app_id, dataset_id, content_hash, body, size_bytes, created_at_ms)"
                " VALUES (?,?,?,?,?,?,?)",
                [(sid, app_id, dataset_id, h, body_to_json(b), b.size_bytes, ts) for sid, h, b in new],
            )
            ds = _dataset(c, app_id, dataset_id)
        return AppendResult(len(new), dups, tuple(ids), ds)

    def get_dataset(self, app_id: str, dataset_id: str) -> Dataset:
        """One dataset of the app.

        Raises:
            NotFound: absent or another app's.
        """
        with self.db.read() as c:
            return _dataset(c, app_id, dataset_id)

    def list_datasets(self, app_id: str, size: int, token: str) -> tuple[list[Dataset], str]:
        """The app's datasets ordered by id; returns (page, next_page_token)."""
        after = decode_cursor(token) if token else ""
        if after is None:
            raise InvalidArgument("page_token", "malformed; pass next_page_token back unchanged")
        limit = page_size(size)
        with self.db.read() as c:
            rows = c.execute(
                "SELECT dataset_id FROM datasets WHERE app_id=? AND dataset_id > ? ORDER BY dataset_id LIMIT ?",
                (app_id, after, limit + 1),
            ).fetchall()
            page = [_dataset(c, app_id, r["dataset_id"]) for r in rows[:limit]]
        return page, encode_cursor(page[-1].dataset_id) if len(rows) > limit else ""

    def list_samples(self, app_id: str, dataset_id: str, size: int, token: str) -> tuple[list[StoredSample], str]:
        """A dataset's samples, oldest first; returns (page, next_page_token).

        Raises:
            NotFound: absent or another app's dataset.
        """
        after = decode_int_cursor(token, 0)
        limit = page_size(size)
        with self.db.read() as c:
            _dataset(c, app_id, dataset_id)
            rows = c.execute(
                "SELECT * FROM samples WHERE app_id=? AND dataset_id=? AND seq > ? ORDER BY seq LIMIT ?",
                (app_id, dataset_id, after, limit + 1),
            ).fetchall()
        page = [
            StoredSample(r["sample_id"], r["created_at_ms"], r["size_bytes"], body_from_json(r["body"]))
            for r in rows[:limit]
        ]
        return page, encode_cursor(str(rows[limit - 1]["seq"])) if len(rows) > limit else ""

    def training_samples(self, app_id: str, dataset_ids: Sequence[str], until_ms: int) -> list[SampleBody]:
        """Samples of the given datasets committed at or before ``until_ms``, oldest first."""
        marks = ",".join("?" * len(dataset_ids))
        with self.db.read() as c:
            rows = c.execute(
                f"SELECT body FROM samples WHERE app_id=? AND dataset_id IN ({marks}) AND created_at_ms <= ?"
                " ORDER BY seq",
                (app_id, *dataset_ids, until_ms),
            ).fetchall()
        return [body_from_json(r["body"]) for r in rows]

    def existing_datasets(self, app_id: str, dataset_ids: Sequence[str]) -> set[str]:
        """Which of ``dataset_ids`` the app has."""
        with self.db.read() as c:
            return {
                r["dataset_id"]
                for r in c.execute("SELECT dataset_id FROM datasets WHERE app_id=?", (app_id,)).fetchall()
                if r["dataset_id"] in dataset_ids
            }

    def usage(self, app_id: str) -> tuple[int, int]:
        """(sample count, sample bytes) of the app."""
        with self.db.read() as c:
            n, size = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(size_bytes),0) FROM samples WHERE app_id=?", (app_id,)
            ).fetchone()
        return int(n), int(size)
