"""Durable deletion intents (marker files) and the disk-space reserve that lets deletions run on a full disk."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

PENDING_DIR = "pending"
SEP = "@"  # never part of an id (ids match [a-z0-9._-]), so a marker name splits back into its ids
RESERVE_FILE = "reserve.bin"
RESERVE_BYTES = 4 << 20  # 4 MiB: room for one purge batch's WAL frames (≤ 1 MiB of rows) several times over


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record(data_dir: Path, kind: str, *ids: str) -> Path | None:
    """Writes the intent ``kind`` for ``ids`` durably before any deletion starts; None if the disk refuses even that.

    An empty file needs no data blocks, so this usually works on a full disk too; if it does not, the deletion
    still runs (it is what frees the space), only without crash recovery.
    """
    d = data_dir / PENDING_DIR
    path = d / SEP.join((kind, *ids))
    try:
        d.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        _fsync_dir(d)
    except OSError as exc:
        log.warning("intent_not_recorded", kind=kind, errno=exc.errno)
        return None
    return path


def clear(path: Path | None) -> None:
    """Removes a finished intent."""
    if path is None:
        return
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        _fsync_dir(path.parent)


def pending(data_dir: Path) -> list[tuple[Path, str, tuple[str, ...]]]:
    """Intents left by an interrupted run, oldest first: (marker, kind, ids)."""
    d = data_dir / PENDING_DIR
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.iterdir(), key=lambda p: p.stat().st_mtime_ns):
        kind, *ids = p.name.split(SEP)
        out.append((p, kind, tuple(ids)))
    return out


class SpaceReserve:
    """A preallocated file given back to the filesystem when a deletion hits a full disk, recreated afterwards."""

    def __init__(self, data_dir: Path, size: int = RESERVE_BYTES) -> None:
        self.path = data_dir / RESERVE_FILE
        self.size = size

    def ensure(self) -> bool:
        """Creates the reserve if it is missing and the space is there; True if it exists afterwards."""
        if self.path.exists():
            return True
        tmp = self.path.with_name(f".tmp-{RESERVE_FILE}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
                os.fsync(fd)
            finally:
                os.close(fd)
            tmp.replace(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("space_reserve_failed", errno=exc.errno)
            return False
        return True

    def release(self) -> bool:
        """Frees the reserve; True if there was one to free."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        log.info("space_reserve_released", bytes=self.size)
        return True
