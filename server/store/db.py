"""One SQLite connection in WAL mode, serialised by a lock, with versioned schema migrations."""

from __future__ import annotations

import base64
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog

from lorad.server.store.migrations import MIGRATIONS

log = structlog.get_logger(__name__)


def now_ms() -> int:
    """Current Unix time in milliseconds."""
    return time.time_ns() // 1_000_000


def new_id(prefix: str) -> str:
    """A time-ordered id, e.g. ``job_0193a1b2c3d4e5f6a7b8``: 12 hex digits of ms, then 8 random hex digits."""
    return f"{prefix}_{now_ms():012x}{secrets.token_hex(4)}"


def encode_cursor(value: str) -> str:
    """Opaque page token for a cursor value."""
    return base64.urlsafe_b64encode(value.encode()).decode().rstrip("=")


def decode_cursor(token: str) -> str | None:
    """The cursor inside a page token, None for a malformed one (callers raise InvalidArgument)."""
    try:
        return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


INT64_MAX = 2**63 - 1  # SQLite integers are signed 64-bit


def decode_int_cursor(token: str, default: int) -> int:
    """The integer cursor inside a page token (``default`` for an empty token).

    Raises:
        InvalidArgument: malformed, or not a cursor this daemon could have issued (outside 0 … 2^63-1).
    """
    from lorad.server.errors import InvalidArgument

    if not token:
        return default
    raw = decode_cursor(token)
    if raw is None or not raw.isascii() or not raw.isdigit() or len(raw) > 19 or int(raw) > INT64_MAX:
        raise InvalidArgument("page_token", "malformed; pass next_page_token back unchanged")
    return int(raw)


def page_size(requested: int) -> int:
    """The API's paging rule: 0 means 100, values above 1000 are clamped."""
    return 100 if requested <= 0 else min(requested, 1000)


def require_active_app(c: sqlite3.Connection, app_id: str) -> None:
    """Inside a write transaction: refuses to store anything for a revoked (or unknown) app.

    Revocation commits in its own transaction, so a write either commits before it or is refused here.
    """
    from lorad.server.errors import Unauthenticated

    row = c.execute("SELECT revoked FROM apps WHERE app_id=?", (app_id,)).fetchone()
    if row is None or row["revoked"]:
        raise Unauthenticated("unknown or revoked token")


class Database:
    """The daemon's SQLite database. Thread-safe: every use holds one lock (SQLite serialises writers anyway)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so a whole append is one transaction.
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise RuntimeError(f"SQLite refused WAL mode (got {mode!r}) for {path}")
        # FULL: a commit is on disk before we acknowledge it (samples are acknowledged only after commit).
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.execute("PRAGMA busy_timeout=5000")
        # Deleted rows are overwritten with zeros: forgotten samples must not linger in free pages of the file.
        self._conn.execute("PRAGMA secure_delete=ON")
        self._migrate()

    @property
    def schema_version(self) -> int:
        """The applied schema version."""
        with self._lock:
            return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        current = self.schema_version
        for version, sql in MIGRATIONS:
            if version <= current:
                continue
            with self.tx() as c:
                for stmt in (s.strip() for s in sql.split(";")):
                    if stmt:
                        c.execute(stmt)
                c.execute(f"PRAGMA user_version={version}")
            log.info("store_migrated", version=version, path=str(self.path))

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE … COMMIT); rolls back on any exception."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._rollback()
                raise
            try:
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        # SQLite rolls back by itself on some errors (SQLITE_FULL, SQLITE_IOERR): a second ROLLBACK would raise
        # "cannot rollback - no transaction is active" and hide the real error.
        if self._conn.in_transaction:
            try:
                self._conn.execute("ROLLBACK")
            except sqlite3.OperationalError:
                log.warning("store_rollback_failed")

    def checkpoint_truncate(self) -> None:
        """Copies the WAL into the database file and truncates it (frees its disk space; drops old page images)."""
        with self._lock:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A consistent read (one implicit transaction per statement; the lock keeps writers out meanwhile)."""
        with self._lock:
            yield self._conn

    def close(self) -> None:
        """Closes the connection (checkpoints the WAL)."""
        with self._lock:
            self._conn.close()
