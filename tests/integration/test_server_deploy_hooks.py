"""Deploy hooks: [device] wake-lock commands around training and at shutdown; a foreign qnn_bundle is refused."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from lorad.v1 import jobs_pb2
from tests.integration.helpers import GOOD_PROBE, append, create_job, wait_for, wait_state

pytestmark = pytest.mark.integration


def _recorder(tmp: Path) -> tuple[str, Path]:
    log = tmp / "wakelock.log"
    script = tmp / "wakelock.sh"
    script.write_text(f'#!/bin/sh\necho "$1" >> "{log}"\n')
    script.chmod(0o755)
    return str(script), log


def _calls(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def _config(tmp: Path, model: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    probe = tmp / "probe.json"
    probe.write_text(json.dumps(GOOD_PROBE))
    values: dict[str, Any] = {
        "storage": {"data_dir": str(tmp / "data")},
        "server": {"shutdown_grace_seconds": 1.0},
        "conditions": {"probe": "file", "probe_file": str(probe), "poll_seconds": 0.1},
        "training": {"default_model": str(model), "backend": "torch"},
        "logging": {"level": "warning"},
    }
    for name, sec in sections.items():
        values[name] = {**values.get(name, {}), **sec}
    return values


def test_wake_lock_is_held_only_while_a_job_trains_and_released_at_shutdown(tmp_path: Path, tiny_llama: Path) -> None:
    import grpc

    from lorad.server.config import build_config
    from lorad.server.daemon import Daemon
    from lorad.v1 import apps_pb2
    from tests.integration.helpers import Stubs

    script, log = _recorder(tmp_path)
    device = {"wake_lock_acquire": f"{script} acquire", "wake_lock_release": f"{script} release"}
    cfg = build_config(_config(tmp_path, tiny_llama, device=device), env={})
    d = Daemon(cfg)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(d.start(), loop).result(60)
        ch = grpc.insecure_channel(f"unix:{d.socket_path}")
        owner = Stubs(ch, (cfg.data_dir / "owner.token").read_text().strip())
        token = owner.apps.RegisterApp(apps_pb2.RegisterAppRequest(app_id="notes"), metadata=owner.md).token
        app = Stubs(ch, token)
        assert _calls(log) == [], "no job trains yet: no wake lock"
        append(app)
        job = create_job(app, steps=3)
        done = wait_state(app, job.job_id, {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED}, 90)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.error
        wait_for(lambda: _calls(log) == ["acquire", "release"], 10, "acquire on RUNNING, release after it")
        ch.close()
    finally:
        asyncio.run_coroutine_threadsafe(d.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert _calls(log) == ["acquire", "release", "release"], "released once more at shutdown"


def _foreign_bundle(root: Path) -> str:
    """A well-formed bundle manifest for another model (hand-written, as tests/unit/deploy does; no QNN needed)."""
    from lorad.server.engine.prepare.build import versions
    from lorad.server.engine.prepare.manifest import GraphEntry, Manifest, ResolvedPlan, sha256_file, write_manifest

    (root / "contexts").mkdir(parents=True)
    f = root / "contexts/a_ctx.onnx"
    f.write_bytes(b"graph bytes")
    other = "ab" * 32
    write_manifest(root, Manifest(
        model_hash=other, model_name="some-other-model", model_arch="qwen2", soc_chip="SM8650",
        soc_name="Snapdragon 8 Gen 3", soc_model="57", htp_arch="75", buckets=(32,),
        plan=ResolvedPlan({"lm_head": ("fp16", "fp16")}),
        graphs=(GraphEntry("lm_head", "fwd", 32, "fp16", "contexts/a_ctx.onnx", f.stat().st_size, sha256_file(f)),),
        created_at="2026-01-01T00:00:00+00:00", host="x86_64", **versions(),
    ))  # fmt: skip
    return other


def test_a_bundle_for_another_model_is_refused_at_startup(tmp_path: Path, tiny_llama: Path) -> None:
    from lorad.server.engine.prepare import model_hash_of_folder

    other = _foreign_bundle(tmp_path / "bundle")
    values = _config(tmp_path, tiny_llama, training={"backend": "auto", "qnn_bundle": str(tmp_path / "bundle")})
    lines = []
    for section, sec in values.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in sec.items()]
    conf = tmp_path / "lorad.toml"
    conf.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "LORAD_CONFIG": ""}
    r = subprocess.run([sys.executable, "-m", "lorad.server", "--config", str(conf)], env=env, capture_output=True,
                       text=True, timeout=120, check=False)  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "training.qnn_bundle" in r.stderr and "refused" in r.stderr, r.stderr
    assert "some-other-model" in r.stderr and other[:12] in r.stderr, r.stderr
    assert model_hash_of_folder(tiny_llama)[:12] in r.stderr, "names the daemon's own model hash too"
    assert "lorad prepare" in r.stderr, "says how to make the right bundle"
    assert not (tmp_path / "data" / "run" / "lorad.sock").exists(), "nothing was served"
