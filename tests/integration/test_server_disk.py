"""Disk use and garbage collection over gRPC and the CLI: per app, isolated, the owner sees all and the caches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lorad.v1 import adapters_pb2, device_pb2, jobs_pb2
from tests.integration.helpers import FINAL, append, create_job, wait_state

pytestmark = pytest.mark.integration


def _download(app: Any, adapter_id: str, fmt: int) -> bytes:
    req = adapters_pb2.DownloadAdapterRequest(adapter_id=adapter_id, format=fmt)
    return b"".join(
        m.chunk for m in app.adapters.DownloadAdapter(req, metadata=app.md) if m.WhichOneof("payload") == "chunk"
    )


def _usage(stubs: Any) -> Any:
    return stubs.device.GetDiskUsage(device_pb2.GetDiskUsageRequest(), metadata=stubs.md)


def _gc(stubs: Any) -> Any:
    return stubs.device.CollectGarbage(device_pb2.CollectGarbageRequest(), metadata=stubs.md)


def _cli(tmp: Path, data_dir: Path, *argv: str, token: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env.update(HOME=str(tmp), LORAD_CLIENT_CONFIG=str(tmp / "client.toml"), LORAD_STORAGE_DATA_DIR=str(data_dir))
    if token:
        env["LORAD_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "lorad.client.cli", *argv], check=False, capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


def test_disk_usage_is_per_app_and_gc_removes_only_rebuildable_files(make_daemon: Any, tmp_path: Path) -> None:
    d = make_daemon()
    a, a_token = d.register("notes")
    b, _ = d.register("other")
    append(a)
    job = create_job(a, steps=2)
    done = wait_state(a, job.job_id, FINAL, 120)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.error
    peft = _download(a, done.adapter_id, adapters_pb2.ADAPTER_FORMAT_PEFT)
    _download(a, done.adapter_id, adapters_pb2.ADAPTER_FORMAT_MERGED)
    exports = d.data_dir / "apps" / "notes" / "adapters" / done.adapter_id / "exports"
    on_disk = sum(p.stat().st_size for p in exports.iterdir())

    (mine,) = _usage(a).apps
    assert mine.app_id == "notes" and mine.export_bytes == on_disk > len(peft)
    assert mine.data_bytes > 0 and mine.adapter_bytes > 0 and mine.checkpoint_bytes == 0, "checkpoints go on success"
    u = _usage(a)
    assert u.cache_bytes == 0 and u.database_bytes == 0, "shared numbers are the owner's"
    assert [x.app_id for x in _usage(b).apps] == ["other"], "an app sees only its own"
    owner = _usage(d.owner())
    assert sorted(x.app_id for x in owner.apps) == ["notes", "other"]
    assert owner.cache_bytes > 0 and owner.database_bytes > 0 and owner.export_cache_limit_bytes == 1024 * 1024 * 1024

    assert _gc(b).freed_bytes == 0 and exports.is_dir() and any(exports.iterdir()), "another app's gc leaves ours"
    g = _gc(a)
    assert g.freed_bytes == on_disk and g.removed_files == 4 and _usage(a).apps[0].export_bytes == 0
    again = _download(a, done.adapter_id, adapters_pb2.ADAPTER_FORMAT_PEFT)
    assert again == peft, "rebuilt on demand, same bytes"

    r = _cli(tmp_path, d.data_dir, "du", "--json", token=a_token)
    assert r.returncode == 0, r.stderr
    assert [x["app_id"] for x in json.loads(r.stdout)["apps"]] == ["notes"]
    r = _cli(tmp_path, d.data_dir, "du", "--all")
    assert r.returncode == 0 and "other" in r.stdout and "shared caches" in r.stdout, r.stderr
    r = _cli(tmp_path, d.data_dir, "gc", "--all")
    assert r.returncode == 0 and r.stdout.startswith("freed "), r.stderr
    assert _usage(d.owner()).cache_bytes == 0 and _usage(a).apps[0].export_bytes == 0


def test_a_start_removes_what_a_kill_stranded_and_keeps_the_rest(make_daemon: Any) -> None:
    """Killed between moving an adapter into place and committing its record, or in the middle of building an
    export: the next start removes the folder nothing lists and the export's temp files and merged-model folder,
    and keeps the adapter and its finished exports."""
    d = make_daemon()
    a, token = d.register("notes")
    append(a)
    done = wait_state(a, create_job(a, steps=2).job_id, FINAL, 120)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.error
    peft = _download(a, done.adapter_id, adapters_pb2.ADAPTER_FORMAT_PEFT)
    d.stop()
    adapters = d.data_dir / "apps" / "notes" / "adapters"
    exports = adapters / done.adapter_id / "exports"
    finished = sorted(p.name for p in exports.iterdir())
    stray = adapters / "adp_killedbeforecommit" / "peft"
    stray.mkdir(parents=True)
    (stray / "adapter_model.safetensors").write_bytes(b"\0" * 4096)
    (exports / f".tmp-{done.adapter_id}.merged.tar.x1y2").write_bytes(b"\0" * 4096)
    half = exports / f"{done.adapter_id}.merged.tar.d"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 4096)

    d = make_daemon()
    assert sorted(p.name for p in adapters.iterdir()) == [done.adapter_id]
    assert sorted(p.name for p in exports.iterdir()) == finished
    a = d.stubs(token)
    listed = a.adapters.ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=a.md).adapters
    assert [x.adapter_id for x in listed] == [done.adapter_id]
    assert _download(a, done.adapter_id, adapters_pb2.ADAPTER_FORMAT_PEFT) == peft
