"""ForgetApp and DeleteDataset are complete and durable: mid-training, on a full disk, and across kill -9."""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
from pathlib import Path

import grpc
import pytest

from lorad.v1 import adapters_pb2, common_pb2, data_pb2, jobs_pb2
from tests.reliability.harness import (
    FINAL,
    SubprocessDaemon,
    all_samples,
    append,
    chat,
    code_of,
    corpus,
    create_job,
    download,
    get_job,
    iter_tree,
    wait_for,
    wait_state,
)

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

SEED = 20261203
KILLS = 10  # per operation: ForgetApp, DeleteDataset, DownloadAdapter


def _rows(data_dir: Path, sql: str, args: tuple = ()) -> list[tuple]:
    conn = sqlite3.connect(f"file:{data_dir / 'lorad.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return list(conn.execute(sql, args).fetchall())
    finally:
        conn.close()


def leftovers(data_dir: Path, app_id: str, secret: bytes, job_ids: list[str]) -> list[str]:
    """Everything under the data dir still derived from the app's forgotten data (files, bytes, rows)."""
    out = []
    files = [p for p in iter_tree(data_dir / "apps" / app_id) if p.is_file()]
    if files:
        out.append(f"files of {app_id} still on disk: {[str(p.relative_to(data_dir)) for p in files][:5]}")
    for p in iter_tree(data_dir):
        if p.is_file() and not p.is_socket():
            if any(j in p.name for j in job_ids):
                out.append(f"file named after a forgotten job: {p.relative_to(data_dir)}")
            try:
                blob = p.read_bytes()
            except OSError:
                continue
            if secret in blob:
                out.append(f"forgotten sample text in {p.relative_to(data_dir)}")
    for table in ("samples", "datasets", "jobs", "adapters", "schedules"):
        n = _rows(data_dir, f"SELECT COUNT(*) FROM {table} WHERE app_id=?", (app_id,))[0][0]
        if n:
            out.append(f"{n} rows left in {table}")
    for j in job_ids:
        for table in ("job_events", "checkpoints"):
            n = _rows(data_dir, f"SELECT COUNT(*) FROM {table} WHERE job_id=?", (j,))[0][0]
            if n:
                out.append(f"{n} rows of {j} left in {table}")
    return out


def _secret_samples(tag: str, n: int = 12) -> list[common_pb2.Sample]:
    return [chat(f"{tag} private question {i}", f"{tag} private answer {i} " + "x" * 200) for i in range(n)]


def _forget(app, timeout: float = 60):
    return app.data.ForgetApp(data_pb2.ForgetAppRequest(), metadata=app.md, timeout=timeout)


def _ckpt_files(data_dir: Path, app_id: str) -> list[Path]:
    return list((data_dir / "apps" / app_id).glob("jobs/*/checkpoints/*"))


def test_forget_while_training_leaves_nothing_behind(tmp_path: Path, tiny_llama: Path, tally) -> None:
    """Issue 11 #1: a checkpoint written by the training thread after ForgetApp returned survived forever."""
    d = SubprocessDaemon(tmp_path / "ftrain", tiny_llama).start()
    try:
        app = d.register("fapp")
        secret = b"zq-forget-secret"
        append(app, "train", corpus(24) + _secret_samples(secret.decode()))
        job = create_job(app, "f1", ("train",), steps=400, checkpoint_every_steps=1, eval_every_steps=1000)
        wait_for(lambda: _ckpt_files(d.data_dir, "fapp"), 120, "a first checkpoint")
        r = _forget(app)
        time.sleep(1.5)  # a step in flight on the worker would finish and checkpoint in this time
        left = leftovers(d.data_dir, "fapp", secret, [job.job_id])
        tally.number("forget: mid-training leftovers", left or "none")
        if left:
            tally.violation(f"forget mid-training left {left[:3]}")
        assert not left, left
        assert r.deleted_jobs == 1 and r.deleted_samples == 48
        # The app can train again right away (nothing of the forgotten run is reused).
        append(app, "train", corpus(24, tag="b"))
        nxt = wait_state(app, create_job(app, "f2", ("train",), steps=2).job_id, FINAL, 120)
        assert nxt.state == jobs_pb2.JOB_STATE_SUCCEEDED, nxt.error
    finally:
        d.stop()


@pytest.fixture
def tmpfs(tmp_path: Path):
    import subprocess

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mnt)], check=False, capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.decode()[:200]}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_delete_and_forget_work_on_a_full_disk(tmpfs: Path, tmp_path: Path, tiny_llama: Path, tally) -> None:
    """Issue 11 #2: on a disk filled by appends, DeleteDataset/ForgetApp were UNKNOWN 'cannot rollback'."""
    d = SubprocessDaemon(
        tmp_path / "full",
        tiny_llama,
        storage={"data_dir": str(tmpfs / "data")},
        quotas={"max_samples": 1_000_000, "max_sample_bytes": 1 << 30},
    )
    d.data_dir = tmpfs / "data"
    d.socket_path = d.data_dir / "run" / "lorad.sock"
    d.start()
    try:
        app = d.register("full")
        keep = append(app, "keep", corpus(6)).sample_ids
        code, i = grpc.StatusCode.OK, 0
        while code == grpc.StatusCode.OK and i < 60:
            big = [common_pb2.Sample(text=f"fill {i} {k} " + "w" * 60_000) for k in range(20)]
            code, _ = code_of(lambda big=big: append(app, f"fill{i % 3}", big))
            i += 1
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code
        got = {
            "delete": code_of(
                lambda: app.data.DeleteDataset(
                    data_pb2.DeleteDatasetRequest(dataset_id="fill0"), metadata=app.md, timeout=60
                )
            )
        }
        d.stop()  # also after a restart on the still-full disk
        d.start()
        app = d.stubs(app.token)
        got["delete after restart"] = code_of(
            lambda: app.data.DeleteDataset(
                data_pb2.DeleteDatasetRequest(dataset_id="fill1"), metadata=app.md, timeout=60
            )
        )
        assert set(keep) <= set(all_samples(app, "keep")), "acknowledged samples lost"
        got["forget"] = code_of(lambda: _forget(app))
        tally.number("full disk: delete/forget", {k: c.name for k, (c, _) in got.items()})
        bad = {k: (c.name, m[:80]) for k, (c, m) in got.items() if c != grpc.StatusCode.OK}
        if bad:
            tally.violation(f"full disk: {bad}")
        assert not bad, bad
        # Deleting freed room: the app stores again.
        assert append(app, "after", [chat("after", "the delete freed space")]).accepted_count == 1
    finally:
        d.stop()
    conn = sqlite3.connect(d.data_dir / "lorad.sqlite")
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()


class _Call(threading.Thread):
    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.code = fn, None

    def run(self) -> None:
        self.code = code_of(self.fn)[0]


def _all_or_nothing(
    d: SubprocessDaemon, app_id: str, secret: bytes, job_ids: list[str], before: int, where: str
) -> str:
    """After a restart the deletion either never started (everything there) or is complete (nothing there)."""
    left = leftovers(d.data_dir, app_id, secret, job_ids)
    if not left:
        return "done"
    n = _rows(
        d.data_dir, "SELECT COUNT(*) FROM samples WHERE app_id=? AND instr(body, ?) > 0", (app_id, secret.decode())
    )[0][0]
    if n == before:
        return "not started"
    raise AssertionError(f"{where}: half done after restart ({n}/{before} samples left): {left[:4]}")


def test_kill9_during_forget_delete_and_download(tmp_path: Path, tiny_llama: Path, tally) -> None:
    """Crash points: kill -9 at seeded random moments during ForgetApp, DeleteDataset and DownloadAdapter."""
    rng = random.Random(SEED)
    d = SubprocessDaemon(tmp_path / "kills", tiny_llama).start()
    keeper = d.register("keeper")
    acked = set(append(keeper, "keep", corpus(12, tag="k")).sample_ids)
    app = d.register("victim")
    token, keeper_token = app.token, keeper.token
    outcomes: dict[str, list[str]] = {"forget": [], "delete": [], "download": []}

    def restart() -> None:
        nonlocal app, keeper
        d.start()
        app, keeper = d.stubs(token), d.stubs(keeper_token)
        lost = acked - set(all_samples(keeper, "keep"))
        if lost:
            tally.violation(f"kill: {len(lost)} acknowledged samples of another app lost")
        assert not lost
        tally.crash_survived()

    try:
        # ForgetApp while the app's job trains and checkpoints every step.
        for k in range(KILLS):
            secret = f"zq-f{k}-secret".encode()
            append(app, "train", corpus(12, tag=f"f{k}") + _secret_samples(secret.decode(), 6))
            job = create_job(app, f"f{k}", ("train",), steps=400, checkpoint_every_steps=1, eval_every_steps=1000)
            wait_for(lambda: _ckpt_files(d.data_dir, "victim"), 120, "a checkpoint")
            call = _Call(lambda: _forget(app))
            call.start()
            time.sleep(rng.uniform(0.0, 0.25))
            d.kill9()
            call.join(10)
            restart()
            how = _all_or_nothing(d, "victim", secret, [job.job_id], 6, f"forget kill #{k}")
            outcomes["forget"].append(how)
            if how != "done":
                _forget(app)
                assert not leftovers(d.data_dir, "victim", secret, [job.job_id])
        # DeleteDataset (with its reading job cancelled) while the job trains.
        for k in range(KILLS):
            secret = f"zq-d{k}-secret".encode()
            stored = append(app, "gone", corpus(12, tag=f"d{k}") + _secret_samples(secret.decode(), 6)).accepted_count
            job = create_job(app, f"d{k}", ("gone",), steps=400, checkpoint_every_steps=1, eval_every_steps=1000)
            wait_for(lambda: _ckpt_files(d.data_dir, "victim"), 120, "a checkpoint")
            req = data_pb2.DeleteDatasetRequest(dataset_id="gone", cancel_dependents=True)
            call = _Call(lambda req=req: app.data.DeleteDataset(req, metadata=app.md, timeout=30))
            call.start()
            time.sleep(rng.uniform(0.0, 0.25))
            d.kill9()
            call.join(10)
            restart()
            left = [
                x
                for x in leftovers(d.data_dir, "victim", secret, [job.job_id])
                if "rows left in jobs" not in x and "job_events" not in x
            ]  # the job record itself stays
            n = _rows(d.data_dir, "SELECT COUNT(*) FROM samples WHERE app_id='victim' AND dataset_id='gone'")[0][0]
            if left and n != stored:  # not started is whole: every sample still there (corpus(12) is 18, +6 secret)
                raise AssertionError(f"delete kill #{k}: half done ({n}/{stored} samples left): {left[:4]}")
            outcomes["delete"].append("done" if not left else "not started")
            if left:
                app.data.DeleteDataset(req, metadata=app.md, timeout=30)
            st = get_job(app, job.job_id).state
            assert st in FINAL, jobs_pb2.JobState.Name(st)
        # DownloadAdapter (first download builds and caches the export).
        append(app, "train", corpus(12, tag="dl"))
        done = wait_state(app, create_job(app, "dl", ("train",), steps=2).job_id, FINAL, 120)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.error
        reference = None
        for k in range(KILLS):
            exports = d.data_dir / "apps" / "victim" / "adapters" / done.adapter_id / "exports"
            if k % 2 == 0 and exports.exists():  # half the kills hit a first (export-building) download
                for p in exports.iterdir():
                    p.unlink()
            call = _Call(lambda: download(app, done.adapter_id))
            call.start()
            time.sleep(rng.uniform(0.0, 0.05))
            d.kill9()
            call.join(10)
            restart()
            blob = download(app, done.adapter_id)  # sha256 checked against the header inside
            reference = reference or blob
            if blob != reference:
                tally.violation(f"download kill #{k}: export bytes changed")
            assert blob == reference
            outcomes["download"].append("ok")
        # Forget at the end: the adapter and its exports go too.
        _forget(app)
        assert not leftovers(d.data_dir, "victim", b"zq-", [done.job_id])
        tally.number(
            "crash: forget/delete/download outcomes",
            {
                k: f"{v.count('done')}/{len(v)} finished" if k != "download" else f"{len(v)} ok"
                for k, v in outcomes.items()
            },
        )
    finally:
        d.stop()
    assert not (d.data_dir / "pending").exists() or not os.listdir(d.data_dir / "pending")
    assert adapters_pb2  # imported for the request types used via harness
