"""Disk use per app and for the shared caches, garbage collection of rebuildable files, and the export-cache cap."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import structlog

from lorad.server.jobs.files import Layout, remove_tree, tree_size

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class AppUsage:
    """Bytes of one app's state (data = sample content bytes as stored in the database)."""

    app_id: str
    data_bytes: int
    checkpoint_bytes: int
    adapter_bytes: int
    export_bytes: int


@dataclass(frozen=True)
class Collected:
    """What a garbage collection deleted."""

    freed_bytes: int = 0
    removed_files: int = 0
    caches_kept_reason: str = ""


def _adapter_dirs(layout: Layout, app_id: str) -> list[Path]:
    root = layout.app_dir(app_id) / "adapters"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def remove_stranded(layout: Layout, registered: Callable[[str], set[str]]) -> list[Path]:
    """Deletes what a kill left between a file operation and its commit (called at start, before anything writes).

    - An adapter folder no record names: a kill between moving a finished or imported adapter into place and
      committing its record, or between deleting a record and its folder. Nothing lists it, so nothing would ever
      delete it. ``registered(app_id)`` is the app's recorded adapter ids.
    - An export that was being built: its temp files (named with a leading dot) and the merged model's folder
      (``<name>.d``, a whole model). The export cap counts only finished files, so these would stay until a gc.

    Returns the paths removed.
    """
    apps = layout.data_dir / "apps"
    removed = []
    for app in sorted(p for p in apps.iterdir() if p.is_dir()) if apps.is_dir() else []:
        known = registered(app.name)
        for folder in _adapter_dirs(layout, app.name):
            exports = folder / "exports"
            if folder.name not in known:
                stale = [folder]
            elif exports.is_dir():
                stale = sorted(p for p in exports.iterdir() if p.name.startswith(".") or p.is_dir())
            else:
                continue
            for p in stale:
                remove_tree(p)
                removed.append(p)
                log.info("stranded_files_removed", app_id=app.name, adapter=folder.name, name=p.name)
    return removed


def app_usage(layout: Layout, app_id: str, sample_bytes: int) -> AppUsage:
    """Walks the app's job and adapter folders (a few ms for a few adapters)."""
    adapters = _adapter_dirs(layout, app_id)
    return AppUsage(
        app_id=app_id,
        data_bytes=sample_bytes,
        checkpoint_bytes=tree_size(layout.app_dir(app_id) / "jobs"),
        adapter_bytes=sum(tree_size(a / "peft") for a in adapters),
        export_bytes=sum(tree_size(a / "exports") for a in adapters),
    )


def database_bytes(db_path: Path) -> int:
    """The SQLite file with its WAL and shared-memory files."""
    return sum(tree_size(db_path.with_name(db_path.name + sfx)) for sfx in ("", "-wal", "-shm"))


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [Path(r) / f for r, _, fs in os.walk(path) for f in fs] if path.is_dir() else []


def collect(layout: Layout, app_ids: list[str], cache_root: Path | None, training: bool) -> Collected:
    """Deletes the cached exports of ``app_ids`` and, when ``cache_root`` is given (the owner), the shared caches.

    The shared caches (converted models, precision plans, backend caches) are kept while a job trains: it may be
    reading them. Everything deleted is rebuilt on the next download or job.
    """
    freed = files = 0
    for app_id in app_ids:
        for a in _adapter_dirs(layout, app_id):
            exports = a / "exports"
            files += len(_files(exports))
            freed += remove_tree(exports)
    reason = ""
    if cache_root is not None and cache_root.is_dir():
        if training:
            reason = "a job is training; run gc again when it is done"
        else:
            for child in sorted(cache_root.iterdir()):
                files += len(_files(child))
                freed += remove_tree(child)
    log.info("garbage_collected", apps=len(app_ids), freed_bytes=freed, removed_files=files, caches=not reason)
    return Collected(freed, files, reason)


def export_files(layout: Layout) -> list[Path]:
    """Every app's cached export files (with their .sha256 files)."""
    return sorted(layout.data_dir.glob("apps/*/adapters/*/exports/*"))


def enforce_export_cap(
    layout: Layout, cap_bytes: int, keep: Path, lock_for: Callable[[str], AbstractContextManager[object]]
) -> int:
    """Deletes the least recently used exports until all apps' exports fit in ``cap_bytes``; never ``keep``.

    Exports are rebuilt on demand, so evicting one costs only the next download's rebuild. An open download of an
    evicted file keeps reading it (the inode lives until closed).

    Returns:
        Bytes freed.
    """
    if cap_bytes <= 0:
        return 0
    exports = [p for p in export_files(layout) if p.is_file() and not p.name.startswith(".tmp-")]
    total = sum(p.stat().st_size for p in exports)
    freed = 0
    # Least recently served first: adapter_file() touches a file each time it serves it.
    for p in sorted(exports, key=lambda p: p.stat().st_mtime_ns):
        if total - freed <= cap_bytes:
            break
        if p == keep or p.suffix == ".sha256":  # a digest goes with its file
            continue
        with lock_for(str(p)):  # the lock adapter_file builds and opens this file under
            if not p.exists():
                continue
            size = p.stat().st_size
            digest = p.with_name(p.name + ".sha256")
            p.unlink(missing_ok=True)
            freed += size
            if digest.exists():
                freed += digest.stat().st_size
                digest.unlink(missing_ok=True)
    if freed:
        log.info("export_cache_evicted", freed_bytes=freed, cap_bytes=cap_bytes)
    return freed
