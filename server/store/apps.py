"""Registered apps: token hashes, quotas, revocation."""

from __future__ import annotations

import sqlite3

from lorad.server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from lorad.server.records import App, Quota
from lorad.server.store.db import Database, decode_cursor, encode_cursor, now_ms, page_size


def _app(row: sqlite3.Row, count: int = 0, size: int = 0) -> App:
    quota = Quota(row["max_samples"], row["max_sample_bytes"], row["max_adapters"], row["max_active_jobs"])
    return App(row["app_id"], row["display_name"], row["created_at_ms"], quota, bool(row["revoked"]), count, size)


class AppRepo:
    """Apps table access."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, app_id: str, display_name: str, token_hash: str, quota: Quota) -> App:
        """Registers an app.

        A revoked app whose data is all forgotten is registered afresh under its id (new token and quota).

        Raises:
            AlreadyExists: the id is taken (by an active app, or a revoked one that still has data).
        """
        with self.db.tx() as c:
            row = c.execute("SELECT revoked FROM apps WHERE app_id=?", (app_id,)).fetchone()
            if row is not None and not row["revoked"]:
                raise AlreadyExists(
                    f"app {app_id!r} already exists; pick another app_id, or revoke and forget it "
                    "first to register it again"
                )
            if row is not None:
                if any(
                    c.execute(f"SELECT 1 FROM {t} WHERE app_id=? LIMIT 1", (app_id,)).fetchone()
                    for t in ("datasets", "samples", "jobs", "adapters", "schedules")
                ):
                    raise AlreadyExists(
                        f"app {app_id!r} is revoked but its data is still stored; forget it first "
                        "(ForgetApp / `lorad app forget`), then register it again"
                    )
                c.execute("DELETE FROM apps WHERE app_id=?", (app_id,))
            c.execute(
                "INSERT INTO apps(app_id, display_name, token_hash, created_at_ms, max_samples, max_sample_bytes,"
                " max_adapters, max_active_jobs) VALUES (?,?,?,?,?,?,?,?)",
                (
                    app_id,
                    display_name,
                    token_hash,
                    now_ms(),
                    quota.max_samples,
                    quota.max_sample_bytes,
                    quota.max_adapters,
                    quota.max_active_jobs,
                ),
            )
        return self.get(app_id)

    def app_for_token_hash(self, token_hash: str) -> str | None:
        """The app id of a token hash; None if unknown or revoked (checked per call: revocation is immediate)."""
        with self.db.read() as c:
            row = c.execute("SELECT app_id FROM apps WHERE token_hash=? AND revoked=0", (token_hash,)).fetchone()
        return None if row is None else str(row["app_id"])

    def get(self, app_id: str) -> App:
        """One app with its usage.

        Raises:
            NotFound: unknown id.
        """
        with self.db.read() as c:
            row = c.execute("SELECT * FROM apps WHERE app_id=?", (app_id,)).fetchone()
            if row is None:
                raise NotFound("app", app_id)
            n, size = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(size_bytes),0) FROM samples WHERE app_id=?", (app_id,)
            ).fetchone()
        return _app(row, n, size)

    def list_page(self, size: int, token: str) -> tuple[list[App], str]:
        """Apps ordered by id, one page; returns (apps, next_page_token)."""
        after = decode_cursor(token) if token else ""
        if after is None:
            raise InvalidArgument("page_token", "malformed; pass next_page_token back unchanged")
        limit = page_size(size)
        with self.db.read() as c:
            rows = c.execute(
                "SELECT app_id FROM apps WHERE app_id > ? ORDER BY app_id LIMIT ?", (after, limit + 1)
            ).fetchall()
        ids = [r["app_id"] for r in rows[:limit]]
        nxt = encode_cursor(ids[-1]) if len(rows) > limit else ""
        return [self.get(i) for i in ids], nxt

    def rotate(self, app_id: str, token_hash: str) -> None:
        """Replaces the app's token hash (the old token stops working with this commit).

        Raises:
            NotFound: unknown id.
            FailedPrecondition: the app is revoked.
        """
        with self.db.tx() as c:
            row = c.execute("SELECT revoked FROM apps WHERE app_id=?", (app_id,)).fetchone()
            if row is None:
                raise NotFound("app", app_id)
            if row["revoked"]:
                raise FailedPrecondition(f"app {app_id!r} is revoked; forget it and register it again for a new token")
            c.execute("UPDATE apps SET token_hash=? WHERE app_id=?", (token_hash, app_id))

    def revoke(self, app_id: str) -> None:
        """Revokes the app's token.

        Raises:
            NotFound: unknown id.
        """
        with self.db.tx() as c:
            if c.execute("UPDATE apps SET revoked=1 WHERE app_id=?", (app_id,)).rowcount == 0:
                raise NotFound("app", app_id)
