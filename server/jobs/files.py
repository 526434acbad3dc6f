"""On-disk layout of an app's jobs and adapters, and helpers to remove them."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path


class Layout:
    """Paths under the data directory: ``apps/<app>/jobs/<job>/`` and ``apps/<app>/adapters/<adapter>/``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    def app_dir(self, app_id: str) -> Path:
        """The app's directory."""
        return self.data_dir / "apps" / app_id

    def job_dir(self, app_id: str, job_id: str) -> Path:
        """A job's work directory (checkpoints, the adapter before registration)."""
        return self.app_dir(app_id) / "jobs" / job_id

    def job_dirs(self) -> list[Path]:
        """Every job work directory on disk, of every app (normally the few live or failed jobs)."""
        return sorted(self.data_dir.glob("apps/*/jobs/*"))

    def adapter_dir(self, app_id: str, adapter_id: str) -> Path:
        """A registered adapter's directory: ``peft/`` and cached exports."""
        return self.app_dir(app_id) / "adapters" / adapter_id


_ABS_PATH = re.compile(r"(?<![\w.])(?:/[^\s/'\"`:,;()\[\]]+)+/?")


def scrub_paths(text: str) -> str:
    """``text`` with every absolute path cut to its last part (device paths never reach an app)."""
    return _ABS_PATH.sub(lambda m: "…/" + (m.group(0).rstrip("/").rsplit("/", 1)[-1]), text)


def _file_sizes(path: Path) -> Iterator[int]:
    """The size of ``path`` if it is a file, else of every file under it (none if absent)."""
    if path.is_file():
        yield path.stat().st_size
        return
    for root, _, files in os.walk(path):
        for f in files:
            try:
                yield (Path(root) / f).stat().st_size
            except OSError:
                pass


def tree_size(path: Path) -> int:
    """Bytes of all files under ``path`` (0 if absent)."""
    return sum(_file_sizes(path))


def largest_file(path: Path) -> int:
    """Bytes of the largest file under ``path`` (0 if there is none)."""
    return max(_file_sizes(path), default=0)


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem holding ``path`` (its nearest existing parent when it does not exist yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def remove_tree(path: Path) -> int:
    """Deletes ``path`` (file or directory) and returns the bytes freed."""
    size = tree_size(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
    return size
