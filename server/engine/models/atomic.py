"""Crash-safe file and directory writes: temp file -> fsync -> rename (-> fsync of the parent directory)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Flushes a directory entry table so a completed rename survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flushes one file's data to disk."""
    with path.open("rb") as fh:
        os.fsync(fh.fileno())


def atomic_write(path: Path, write: Callable[[BinaryIO], object], *, tmp_prefix: str = ".") -> None:
    """Writes a file so that readers see the old file or the complete new one, never a partial one.

    Temp file in the same directory (named ``<tmp_prefix><name>.*``) → ``write(f)`` → flush + fsync → rename over
    ``path`` → fsync the directory (so the rename itself survives a power cut). On any error the temp file is
    removed and ``path`` is left untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{tmp_prefix}{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def held_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive flock on `path` (created if absent) for the block; waits while another holder has it.

    flock conflicts between separate opens, so this one lock orders both threads of one process and processes.
    The lock ends with the file descriptor, so a holder killed mid-way never leaves it held.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def building_dir(final: Path) -> Iterator[Path]:
    """A fresh hidden directory next to ``final`` (same filesystem, so the rename is atomic) to build its contents in;
    committed to ``final`` (``commit_dir``) when the block ends, removed if it raises: a folder half written when the
    disk filled up must not go on holding the space the job waiting for it needs."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        yield tmp
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit_dir(tmp: Path, final: Path) -> None:
    """Fsyncs every file in `tmp` and renames it to `final`, replacing an existing directory.

    A replaced directory is first moved aside, so `final` is always either the complete old or the complete new
    version (the swap itself is two renames; a crash between them leaves the old copy under a hidden name).
    """
    for f in tmp.iterdir():
        if f.is_file():
            fsync_file(f)
    fsync_dir(tmp)
    if final.exists():
        old = final.with_name(f".{final.name}.old.{os.getpid()}")
        final.replace(old)
        tmp.replace(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.replace(final)
    fsync_dir(final.parent)
