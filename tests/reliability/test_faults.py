"""Faults: backend failing mid-job, full disk, corrupt files, a hanging device probe."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from lorad.v1 import adapters_pb2, common_pb2, device_pb2, inference_pb2, jobs_pb2
from tests.reliability.harness import (
    FINAL,
    InProcDaemon,
    SubprocessDaemon,
    all_events,
    all_samples,
    append,
    chat,
    code_of,
    corpus,
    create_job,
    get_job,
    wait_for,
    wait_state,
)

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(300)]
CLEAR_CODES = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
               grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE}  # fmt: skip


def test_backend_failing_mid_job_fails_the_job_cleanly(tmp_path: Path, tiny_llama: Path, monkeypatch, tally) -> None:
    """Injected: the frozen-matmul backend raises from its 40th call on (mid-training), whichever of its entry points
    runs the product (the LoRA nodes take a bf16 GEMM's product directly); the daemon must survive."""
    from lorad.kernels import torch_backend

    cls = torch_backend.TorchFrozenLinear
    entry_points = ("forward", "input_grad", "bf16_product", "input_grad_product")
    real = {name: getattr(cls, name) for name in entry_points}
    calls = {"n": 0}

    def failing(name: str):
        def call(self, x, **kw):
            calls["n"] += 1
            if calls["n"] >= 40:
                raise RuntimeError("injected NPU fault: QNN graph execute returned 6031")
            return real[name](self, x, **kw)

        return call

    for name in entry_points:
        monkeypatch.setattr(cls, name, failing(name))
    d = InProcDaemon(tmp_path / "npu", tiny_llama)
    try:
        app = d.register("npu")
        append(app, "train", corpus(24))
        job = create_job(app, "fail", ("train",), steps=20)
        end = wait_state(app, job.job_id, FINAL, 120)
        assert calls["n"] >= 40, "the fault was never reached"
        tally.number("fault: backend failure → job", f"{jobs_pb2.JobState.Name(end.state)} code={end.error.code!r} "
                                                    f"message={end.error.message[:80]!r}")  # fmt: skip
        ok = end.state == jobs_pb2.JOB_STATE_FAILED and end.error.code and end.error.message
        if not ok:
            tally.violation(f"fault: backend failure left job {jobs_pb2.JobState.Name(end.state)} {end.error}")
        assert ok
        assert app.healthy()
        # The NPU is released: with the fault removed the next job trains to the end.
        for name in entry_points:
            monkeypatch.setattr(cls, name, real[name])
        nxt = wait_state(app, create_job(app, "after", ("train",), steps=4).job_id, FINAL, 120)
        assert nxt.state == jobs_pb2.JOB_STATE_SUCCEEDED, nxt.error
    finally:
        d.stop()


@pytest.fixture
def tmpfs(tmp_path: Path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mnt)], check=False, capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.decode()[:200]}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_job_that_fills_the_disk_waits_for_space_and_ends_from_its_checkpoint(
    tmpfs: Path, tmp_path: Path, tiny_llama: Path, tally
) -> None:
    """A night's job must not be lost to a full disk: it waits (DISK_FULL) with its checkpoints kept, starts nothing
    while the space is missing, and once it is freed trains on from its last checkpoint to an adapter."""
    d = SubprocessDaemon(tmp_path / "fill", tiny_llama, storage={"data_dir": str(tmpfs / "data")})
    d.data_dir = tmpfs / "data"
    d.socket_path = d.data_dir / "run" / "lorad.sock"
    d.start()
    try:
        app = d.register("fill")
        append(app, "notes", corpus(24))
        job = create_job(app, "long", ("notes",), steps=400, checkpoint_every_steps=4)
        wait_for(lambda: get_job(app, job.job_id).progress.step >= 8, 120, "training under way")
        filler = _fill(tmpfs)
        waiting = wait_for(lambda: (j := get_job(app, job.job_id)).blocked_reason == jobs_pb2.BLOCKED_REASON_DISK_FULL
                           and j, 60, "the job to wait for disk")  # fmt: skip
        said = f"{jobs_pb2.JobState.Name(waiting.state)} at step {waiting.progress.step}: {waiting.blocked_detail!r}"
        tally.number("fault: a job on a full disk", said)
        assert waiting.state == jobs_pb2.JOB_STATE_WAITING and "MiB are free" in waiting.blocked_detail
        assert waiting.progress.step < 400
        time.sleep(1.0)  # five condition polls: the space is still missing, so the job stays put
        still = get_job(app, job.job_id)
        assert (still.state, still.blocked_reason) == (jobs_pb2.JOB_STATE_WAITING, jobs_pb2.BLOCKED_REASON_DISK_FULL)
        filler.unlink()
        end = wait_state(app, job.job_id, FINAL, 240)
        ok = end.state == jobs_pb2.JOB_STATE_SUCCEEDED and end.progress.step == 400
        tally.number("fault: that job after the space was freed", f"{jobs_pb2.JobState.Name(end.state)} {end.error}")
        if not ok:
            tally.violation(f"fault: a job on a full disk ended {jobs_pb2.JobState.Name(end.state)} {end.error}")
        assert ok, end.error
        ev = all_events(app, job.job_id)
        wait_at = next(i for i, e in enumerate(ev) if e.message.startswith("waiting: no space left"))
        resumed = next(e.progress.step for e in ev[wait_at:] if e.kind == jobs_pb2.JOB_EVENT_KIND_PROGRESS)
        # It went on from its last checkpoint (every 4 steps), not from the start.
        assert waiting.progress.step - 4 < resumed <= waiting.progress.step + 1, (resumed, waiting.progress.step)
        assert d.alive() and app.healthy()
    finally:
        d.stop()


def _fill(path: Path) -> Path:
    """Fills the filesystem of ``path`` completely with one file (unbuffered writes until ENOSPC)."""
    filler = path / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for block in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_disk_full_is_resource_exhausted_and_corrupts_nothing(tmpfs: Path, tmp_path: Path, tiny_llama: Path,
                                                              tally) -> None:  # fmt: skip
    d = SubprocessDaemon(tmp_path / "disk", tiny_llama, storage={"data_dir": str(tmpfs / "data")})
    d.data_dir = tmpfs / "data"
    d.socket_path = d.data_dir / "run" / "lorad.sock"
    d.start()
    app = d.register("disk")
    acked = append(app, "notes", corpus(12)).sample_ids
    filler = _fill(tmpfs)
    codes = []
    for i in range(3):
        big = [common_pb2.Sample(text=f"{i} " + "w" * 60_000) for _ in range(20)]  # ~1.2 MB per call
        codes.append(code_of(lambda big=big: append(app, "notes", big)))
    tally.number("fault: AppendSamples on a full disk", [(c.name, m[:80]) for c, m in codes])
    ok = all(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c, _ in codes)
    if not ok:
        tally.violation(f"fault: full disk → {[(c.name, m[:100]) for c, m in codes]} (expected RESOURCE_EXHAUSTED)")
    alive = d.alive() and app.healthy()
    filler.unlink()
    assert alive, "daemon died on a full disk"
    stored = all_samples(app, "notes")
    assert set(acked) <= set(stored)
    assert append(app, "notes", [chat("after", "the disk was freed")]).accepted_count == 1
    assert d.stop() == 0
    conn = sqlite3.connect(d.data_dir / "lorad.sqlite")
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
    assert ok


def test_corrupt_database_is_a_clear_startup_error(tmp_path: Path, tiny_llama: Path, tally) -> None:
    d = SubprocessDaemon(tmp_path / "cdb", tiny_llama)
    d.start()
    d.register("x")
    assert d.stop() == 0
    db = d.data_dir / "lorad.sqlite"
    raw = bytearray(db.read_bytes())
    raw[:100] = b"\xde\xad\xbe\xef" * 25  # destroys the SQLite header
    db.write_bytes(bytes(raw))
    for p in (d.data_dir / "lorad.sqlite-wal", d.data_dir / "lorad.sqlite-shm"):
        p.unlink(missing_ok=True)
    before = len(d.log_text())
    d.start(wait=False)
    assert d.proc is not None
    try:
        rc = d.proc.wait(60)
    except subprocess.TimeoutExpired:
        d.kill9()
        raise AssertionError("daemon hangs on a corrupt database") from None
    out = d.log_text()[before:]
    last = [ln for ln in out.splitlines() if ln.strip()][-1:] or [""]
    tally.number("fault: corrupt DB at startup", f"exit {rc}; last line {last[0][:160]!r}")
    clear = rc != 0 and str(db) in out and "Traceback" not in out
    if not clear:
        tally.violation(f"fault: corrupt DB → exit {rc}, error does not name {db.name} cleanly: {last[0][:160]!r}")
    assert rc != 0
    assert clear, out[-800:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    """A daemon with one finished adapter and one paused job holding checkpoints (the model is a private copy)."""
    root = tmp_path_factory.mktemp("corrupt")
    model = root / "model"
    shutil.copytree(tiny_llama, model)
    d = SubprocessDaemon(root / "d", model)
    d.start()
    app = d.register("cor")
    append(app, "train", corpus(24))
    done = wait_state(app, create_job(app, "done", ("train",), steps=4).job_id, FINAL, 120)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED
    yield d, app, done, model
    d.stop()


def test_corrupt_adapter_is_a_clear_error_on_use(trained, tally) -> None:
    d, app, done, _ = trained
    rec_dir = next((d.data_dir / "apps" / "cor" / "adapters").glob(f"{done.adapter_id}/peft"))
    w = rec_dir / "adapter_model.safetensors"
    w.write_bytes(b"not a safetensors file" * 10)
    c1, m1 = code_of(
        lambda: app.inference.Generate(
            inference_pb2.GenerateRequest(adapter_id=done.adapter_id, text="hello", max_tokens=2),
            metadata=app.md,
            timeout=60,
        )
    )
    c2, m2 = code_of(
        lambda: app.adapters.DownloadAdapter(
            adapters_pb2.DownloadAdapterRequest(adapter_id=done.adapter_id, format=adapters_pb2.ADAPTER_FORMAT_GGUF),
            metadata=app.md,
            timeout=60,
        )
    )
    tally.number("fault: corrupt adapter", {"Generate": (c1.name, m1[:100]), "Download GGUF": (c2.name, m2[:100])})
    bad = [f"{n} → {c.name} {m[:120]!r}" for n, (c, m) in (("Generate", (c1, m1)), ("DownloadAdapter", (c2, m2)))
           if c not in CLEAR_CODES]  # fmt: skip
    for b in bad:
        tally.violation(f"fault: corrupt adapter: {b}")
    assert app.healthy()
    assert not bad, bad


def test_corrupt_checkpoint_is_a_clear_error_or_skipped(trained, tally) -> None:
    d, app, _, _ = trained
    job = create_job(app, "ck", ("train",), steps=400, checkpoint_every_steps=2)
    wait_state(app, job.job_id, {jobs_pb2.JOB_STATE_RUNNING}, 60)
    time.sleep(1.5)
    app.jobs.PauseJob(jobs_pb2.PauseJobRequest(job_id=job.job_id), metadata=app.md, timeout=10)
    wait_state(app, job.job_id, {jobs_pb2.JOB_STATE_PAUSED}, 60)
    ck_dir = d.data_dir / "apps" / "cor" / "jobs" / job.job_id / "checkpoints"
    files = sorted(ck_dir.glob("step-*.pt"))
    assert files, "pause must leave a checkpoint"
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # torn files under their final names
    mark = all_events(app, job.job_id)[-1].event_id
    app.jobs.ResumeJob(jobs_pb2.ResumeJobRequest(job_id=job.job_id), metadata=app.md, timeout=10)
    # Acceptable: the job FAILS with checkpoint_invalid, or it ignores the torn files and retrains from step 1.
    # Not acceptable: resuming from a torn file, or hanging.
    first_step = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        j = get_job(app, job.job_id)
        steps = [e.progress.step for e in all_events(app, job.job_id, mark)
                 if e.kind in (jobs_pb2.JOB_EVENT_KIND_PROGRESS, jobs_pb2.JOB_EVENT_KIND_EVAL)]  # fmt: skip
        if j.state in FINAL or steps:
            first_step = steps[0] if steps else None
            break
        time.sleep(0.1)
    j = get_job(app, job.job_id)
    tally.number("fault: torn checkpoints on resume", f"{jobs_pb2.JobState.Name(j.state)} {j.error.code!r} "
                                                      f"{j.error.message[:100]!r} first step {first_step}")  # fmt: skip
    ok = (j.state == jobs_pb2.JOB_STATE_FAILED and j.error.code == "checkpoint_invalid") or first_step == 1
    if not ok:
        tally.violation(f"fault: torn checkpoint → {jobs_pb2.JobState.Name(j.state)} {j.error} step {first_step}")
    if j.state not in FINAL:
        app.jobs.CancelJob(jobs_pb2.CancelJobRequest(job_id=job.job_id), metadata=app.md, timeout=10)
    assert app.healthy()
    assert ok


def test_corrupt_model_fails_the_job_clearly(trained, tally) -> None:
    d, app, _, model = trained
    for f in model.glob("*.safetensors"):
        f.write_bytes(b"\0garbage" * 64)
    cache = d.data_dir / "cache"
    if cache.exists():
        shutil.rmtree(cache)  # force the daemon to read the (now corrupt) model files again
    j = wait_state(app, create_job(app, "badmodel", ("train",), steps=4).job_id, FINAL, 120)
    tally.number("fault: corrupt model → job", f"{jobs_pb2.JobState.Name(j.state)} {j.error.code!r} "
                                               f"{j.error.message[:100]!r}")  # fmt: skip
    # A corrupt file is not an out-of-memory condition: the error must point at the model file.
    ok = (
        j.state == jobs_pb2.JOB_STATE_FAILED
        and j.error.code not in ("", "out_of_memory")
        and "safetensors" in j.error.message
    )
    if not ok:
        tally.violation(f"fault: corrupt model → {jobs_pb2.JobState.Name(j.state)} code={j.error.code!r}")
    assert app.healthy()
    assert ok


def test_hanging_probe_means_unknown_and_no_training(tmp_path: Path, tiny_llama: Path, tally) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "termux-battery-status"
    fake.write_text("#!/bin/sh\nexec sleep 3607\n")
    fake.chmod(0o755)
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    d = SubprocessDaemon(
        tmp_path / "hang",
        tiny_llama,
        env=env,
        conditions={"probe": "termux", "termux_timeout_seconds": 1.0, "poll_seconds": 0.5},
    )
    t0 = time.monotonic()
    d.start()
    try:
        app = d.register("hang")
        append(app, "train", corpus(12))
        job = create_job(app, "never", ("train",), steps=4)
        t1 = time.monotonic()
        st = app.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=app.md, timeout=10)
        status_s = time.monotonic() - t1
        assert not st.can_train
        assert jobs_pb2.BLOCKED_REASON_CONDITIONS_UNKNOWN in st.blocked_reasons, st
        time.sleep(3)
        j = get_job(app, job.job_id)
        states = {e.state for e in all_events(app, job.job_id)}
        tally.number(
            "fault: hanging probe",
            f"start {t1 - t0:.1f}s, GetDeviceStatus {status_s * 1e3:.0f} ms, job "
            f"{jobs_pb2.JobState.Name(j.state)} ({j.blocked_detail[:60]!r})",
        )
        assert j.state == jobs_pb2.JOB_STATE_WAITING and j.blocked_reason == jobs_pb2.BLOCKED_REASON_CONDITIONS_UNKNOWN
        assert jobs_pb2.JOB_STATE_RUNNING not in states
        assert status_s < 2.0, "a hanging probe must not block RPCs"
        assert "probe_timeout" in d.log_text()
    finally:
        d.stop()
    # The timed-out probe children were killed, not left sleeping.
    r = subprocess.run(["pgrep", "-f", "sleep 3607"], check=False, capture_output=True, text=True)
    assert not r.stdout.strip(), f"leftover probe processes: {r.stdout}"
