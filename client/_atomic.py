"""Crash-safe file writes for the SDK (temp → fsync → rename → fsync dir); the daemon's twin is engine.models.atomic.

The SDK must not import the daemon (``import lorad.client`` stays free of torch and numpy), hence a twin of
``lorad.server.engine.models.atomic`` rather than an import of it; both follow the same steps.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Flushes a directory entry table so a completed rename survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], object], *, tmp_prefix: str = ".") -> None:
    """Writes a file so that readers see the old file or the complete new one, never a partial one.

    The temp file (``<tmp_prefix><name>.*`` beside ``path``) is created with mode 0600, which the file keeps.
    On any error the temp file is removed and ``path`` is left untouched.
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


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write` of UTF-8 text."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def replace_durably(done: Path, path: Path) -> None:
    """Renames an already fsynced, complete file over ``path`` and fsyncs the directory (resumable downloads)."""
    done.replace(path)
    fsync_dir(path.parent)
