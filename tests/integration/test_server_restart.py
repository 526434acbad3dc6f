"""The daemon as a real process: stopped (SIGTERM) or killed (SIGKILL) mid-job, restarted, the job resumes and ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from lorad.v1 import apps_pb2, jobs_pb2
from tests.integration.helpers import FINAL, GOOD, Stubs, append, create_job, get_job, wait_for, wait_state

pytestmark = pytest.mark.integration


def _start(cfg: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "lorad.server", "--config", str(cfg)], env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)  # fmt: skip


def _connect(sock: Path, token_file: Path, proc: subprocess.Popen) -> grpc.Channel:
    wait_for(lambda: proc.poll() is not None or (sock.exists() and token_file.exists()), 60, "daemon socket")
    assert proc.poll() is None, "daemon exited during start"
    ch = grpc.insecure_channel(f"unix:{sock}")
    grpc.channel_ready_future(ch).result(timeout=30)
    return ch


def _events(app, job_id):
    return app.jobs.ListJobEvents(jobs_pb2.ListJobEventsRequest(job_id=job_id, page_size=1000), metadata=app.md).events


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGKILL, marks=pytest.mark.slow)],
                         ids=["sigterm", "sigkill"])  # fmt: skip
def test_job_resumes_after_restart_as_a_new_process(tmp_path: Path, tiny_llama: Path, sig: int) -> None:
    import json

    data = tmp_path / "data"
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(GOOD))
    cfg = tmp_path / "lorad.toml"
    cfg.write_text(
        f'[storage]\ndata_dir = "{data}"\n[training]\ndefault_model = "{tiny_llama}"\nbackend = "torch"\n'
        f'torch_threads = 1\n[conditions]\nprobe = "file"\nprobe_file = "{probe}"\npoll_seconds = 0.2\n'
        '[logging]\nformat = "json"\n'
    )
    sock, token_file, log = data / "run" / "lorad.sock", data / "owner.token", tmp_path / "daemon.log"
    proc = _start(cfg, log)
    try:
        ch = _connect(sock, token_file, proc)
        owner = Stubs(ch, token_file.read_text().strip())
        token = owner.apps.RegisterApp(apps_pb2.RegisterAppRequest(app_id="notes"), metadata=owner.md).token
        app = Stubs(ch, token)
        append(app)
        job = create_job(app, steps=30, checkpoint_every_steps=3, eval_every_steps=1000)
        wait_for(lambda: get_job(app, job.job_id).progress.step >= 4, 90, "training under way")
        ch.close()
        proc.send_signal(sig)
        rc = proc.wait(60)
        assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL), log.read_text()[-2000:]

        proc = _start(cfg, log)
        ch = _connect(sock, token_file, proc)
        app = Stubs(ch, token)
        done = wait_state(app, job.job_id, FINAL, 180)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.error
        ev = _events(app, job.job_id)
        msgs = [e.message for e in ev if e.message]
        if sig == signal.SIGTERM:
            # Graceful stop: checkpoint at the current step, queued for the next start.
            stopped = [m for m in msgs if m.startswith("paused at step") and "daemon stopping" in m]
            assert stopped, msgs
            resumed_at = int(stopped[0].split()[3])
        else:
            restarted = [m for m in msgs if m.startswith("daemon restarted; resumes from checkpoint step")]
            assert restarted, msgs
            resumed_at = int(restarted[0].rsplit(" ", 1)[1])
        assert f"resumed from checkpoint step {resumed_at}" in msgs and resumed_at >= 3, msgs
        # Every step is a PROGRESS event; step 0 is the EVAL of the base model's held-out loss.
        steps = [e.progress.step for e in ev if e.kind == jobs_pb2.JOB_EVENT_KIND_PROGRESS
                 or (e.kind == jobs_pb2.JOB_EVENT_KIND_EVAL and e.progress.step == 0)]  # fmt: skip
        if sig == signal.SIGTERM:
            # A graceful stop checkpoints at the step it stopped at: nothing is trained twice.
            # Step 0 is the base model's held-out loss, measured once: the restarted daemon does not measure it again.
            assert steps == [0, *range(1, 31)], steps
        else:
            # After kill -9 the steps since the last periodic checkpoint are redone; the tail is complete.
            assert steps[-(30 - resumed_at) :] == list(range(resumed_at + 1, 31))
            assert steps.count(0) == 1, steps
        assert done.adapter_id
        ch.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0
    assert not sock.exists()
