"""What an idle daemon holds: `lorad serve` starts without torch, answers status about a model already in the cache
without it, and reading a new model's facts does not keep the conversion's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorad.server.allocator import find_tcmalloc


def _serve(tmp_path: Path, **env_extra: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """A real `python -m lorad.server` on a unix socket under ``tmp_path``, once its socket is up; and the env of a
    CLI talking to it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env["LORAD_TRAINING_ALLOCATOR"] = "system"  # no re-exec for tcmalloc: the pid below stays the daemon's
    env.update(env_extra)
    sock = tmp_path / "d.sock"
    cmd = [sys.executable, "-m", "lorad.server", "--data-dir", str(tmp_path / "data"), "--socket", str(sock)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no daemon socket within 60 s: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    cli = {
        **env,
        "HOME": str(tmp_path),
        "LORAD_STORAGE_DATA_DIR": str(tmp_path / "data"),
        "LORAD_TARGET": f"unix://{sock}",
    }
    return proc, cli


def _torch_mapped(proc: subprocess.Popen[str]) -> bool:
    assert proc.poll() is None, "the daemon exited"
    return "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()


def test_the_daemon_starts_without_importing_torch(tmp_path: Path) -> None:
    """Before any model is needed the daemon has not loaded torch (~200 MB and seconds of start on a phone)."""
    proc, _ = _serve(tmp_path)
    try:
        time.sleep(1.0)  # the job runner's start (recovery, checkpoint listing) runs just after the bind
        assert not _torch_mapped(proc), "lorad serve imported torch before any model was needed"
    finally:
        proc.terminate()
        proc.wait(30)


def test_status_about_a_cached_model_does_not_import_torch(tmp_path: Path) -> None:
    """Apps poll status; a model the cache already knows is described from its manifest and safetensors headers
    (family, parameter count, hash), so polling an idle daemon keeps it at its small start-up size."""
    from lorad.server.engine.api import read_weights, resolve
    from tests.fixtures.tiny_hf import save_tiny_hf

    model = save_tiny_hf(tmp_path / "m", "qwen2")
    (tmp_path / "data").mkdir(mode=0o700)
    ck = resolve(model, tmp_path / "data" / "cache")  # hashed once, as the daemon's first job would have done
    proc, cli = _serve(tmp_path, LORAD_TRAINING_DEFAULT_MODEL=str(model))
    try:
        lorad = [sys.executable, "-m", "lorad.client.cli"]
        reg = subprocess.run([*lorad, "app", "register", "probe", "--save"], env=cli, check=False,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert reg.returncode == 0, reg.stderr
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run([*lorad, "status", "--json"], env=cli,
                                 check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
            assert out.returncode == 0, out.stderr
            (m,) = json.loads(out.stdout)["models"]
            if m["parameters"]:
                break
            assert time.monotonic() < deadline, f"facts still unknown after 60 s: {m}"
            time.sleep(0.2)
        assert (m["family"], m["sha256"]) == ("qwen2", ck.model_hash), m
        assert int(m["parameters"]) == read_weights(ck.path).parameter_count()
        assert not _torch_mapped(proc), "status about a cached model imported torch"
    finally:
        proc.terminate()
        proc.wait(30)


CONVERT = """
import sys, tempfile
from pathlib import Path
import torch  # the daemon's engine is imported before it converts; what the conversion leaves is what counts
from lorad.server.engine.api import resolve
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024
before = rss_mb()
with tempfile.TemporaryDirectory() as d:
    resolve(None, Path(d))
    print(before, rss_mb())
"""


@pytest.mark.parametrize("malloc", ["system", "tcmalloc"])
def test_a_first_conversion_gives_its_memory_back(malloc: str, tmp_path: Path) -> None:
    """A status call converts the bundled GGUF once (full-size float copies of every weight): the daemon must not
    keep that heap afterwards (it kept ~700 MB under tcmalloc, ~200 MB under glibc)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if malloc == "tcmalloc":
        lib = find_tcmalloc()
        if lib is None:
            pytest.skip("no tcmalloc installed here")
        env["LD_PRELOAD"] = str(lib)
    out = subprocess.run(
        [sys.executable, "-c", CONVERT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=True
    )
    before, after = map(int, out.stdout.splitlines()[-1].split())  # the log goes to stdout too
    assert after - before < 120, f"{after - before} MB kept after converting a 270 MB model ({before} -> {after})"
