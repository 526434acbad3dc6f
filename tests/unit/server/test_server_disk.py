"""The export-cache cap: least recently served exports go first, never the one just built, digests go along."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from lorad.server.disk import enforce_export_cap
from lorad.server.jobs.files import Layout

_LOCKS: dict[str, threading.Lock] = {}


def _lock(key: str) -> threading.Lock:
    return _LOCKS.setdefault(key, threading.Lock())


def _export(root: Path, app: str, adapter: str, name: str, size: int, mtime_s: int) -> Path:
    d = root / "apps" / app / "adapters" / adapter / "exports"
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_bytes(b"x" * size)
    (d / f"{name}.sha256").write_text("0" * 64)
    os.utime(p, (mtime_s, mtime_s))
    return p


def test_cap_evicts_least_recently_served_across_apps_and_keeps_the_new_one(tmp_path: Path) -> None:
    old = _export(tmp_path, "a", "adp_1", "adp_1.merged.tar", 600, 1_000)
    mid = _export(tmp_path, "b", "adp_2", "adp_2.peft.tar", 300, 2_000)
    new = _export(tmp_path, "a", "adp_3", "adp_3.merged.tar", 600, 500)  # just built, oldest mtime on purpose
    freed = enforce_export_cap(Layout(tmp_path), 1_100, new, _lock)  # 1,692 B with the digests
    assert not old.exists() and not old.with_name(old.name + ".sha256").exists()
    assert mid.exists() and new.exists() and freed == 600 + 64
    assert enforce_export_cap(Layout(tmp_path), 0, new, _lock) == 0, "0 = no cap"
    # Still above the cap with only the kept file left: the kept file is never evicted.
    enforce_export_cap(Layout(tmp_path), 100, new, _lock)
    assert new.exists() and not mid.exists()
