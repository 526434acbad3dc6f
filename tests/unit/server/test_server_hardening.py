"""Issue 11 units: validation of floats/enums/int64, page cursors, path scrubbing, the data-dir lock, re-register."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lorad.server import auth, intents
from lorad.server.auth import hash_token
from lorad.server.engine.training.config import job_config
from lorad.server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted, Unauthenticated
from lorad.server.jobs.files import scrub_paths
from lorad.server.records import Blocked, JobSpec, JobState, Quota, Requirements, SampleBody
from lorad.server.rpc.convert import training_raw
from lorad.server.singleton import DataDirLock, StartRefusedError, private_dir
from lorad.server.store import AdapterRepo, AppRepo, Database, JobRepo, SampleRepo
from lorad.server.store.db import decode_int_cursor
from lorad.server.validation import build_params, check_int64
from lorad.v1 import common_pb2

Q = Quota(max_samples=50, max_sample_bytes=10_000, max_adapters=1, max_active_jobs=3)
SPEC = JobSpec(("ds",), job_config({"steps": 3}), Requirements(True, 50, 40.0, False))


@pytest.fixture
def db(tmp_path: Path) -> Database:
    return Database(tmp_path / "s.sqlite")


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (common_pb2.TrainingConfig(lora=common_pb2.LoraConfig(alpha=float("nan"))), "config.lora.alpha"),
        (common_pb2.TrainingConfig(lora=common_pb2.LoraConfig(alpha=float("inf"))), "config.lora.alpha"),
        (common_pb2.TrainingConfig(max_grad_norm=float("nan")), "config.max_grad_norm"),
        (common_pb2.TrainingConfig(learning_rate=float("-inf")), "config.learning_rate"),
        (common_pb2.TrainingConfig(backend=42), "config.backend"),
        (common_pb2.TrainingConfig(precision=99), "config.precision"),
        (common_pb2.TrainingConfig(lr_schedule=42), "config.lr_schedule"),
    ],
)
def test_create_job_config_rejects_non_finite_and_unknown_enums(config: common_pb2.TrainingConfig, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        build_params(training_raw(config))
    assert e.value.field == field


def test_known_enums_and_defaults_still_pass() -> None:
    p = build_params(training_raw(common_pb2.TrainingConfig(backend=common_pb2.BACKEND_TORCH, lr_schedule=2)))
    assert p.backend == "torch" and p.alpha == 16.0 and p.max_grad_norm == 1.0


def test_int64_fields_and_cursors() -> None:
    with pytest.raises(InvalidArgument, match="after_event_id"):
        check_int64("after_event_id", 2**63)
    assert check_int64("x", 2**63 - 1) == 2**63 - 1
    for raw in (str(2**63), "²", "-1", "1" * 30):
        tok = base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")
        with pytest.raises(InvalidArgument, match="page_token"):
            decode_int_cursor(tok, 0)
    assert decode_int_cursor("", 7) == 7


def test_paths_are_cut_from_messages() -> None:
    msg = "No such file or directory: '/data/lorad/apps/a/jobs/j/checkpoints/step-2.pt' (ratio 1/2)"
    out = scrub_paths(msg)
    assert "/data" not in out and "step-2.pt" in out and "1/2" in out


def test_one_daemon_per_data_dir(tmp_path: Path) -> None:
    lock = DataDirLock(tmp_path)
    lock.acquire()
    code = (
        "import sys; from pathlib import Path; from lorad.server.singleton import DataDirLock\n"
        "try:\n    DataDirLock(Path(sys.argv[1])).acquire()\n"
        "except Exception as e:\n    print(e); sys.exit(3)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False)
    assert r.returncode == 3 and f"pid {os.getpid()}" in r.stdout
    lock.release()
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout


def test_private_dir_creates_0700_and_never_chmods(tmp_path: Path) -> None:
    new = tmp_path / "a" / "run"
    private_dir(new, "socket directory")
    assert stat.S_IMODE(new.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(StartRefusedError, match="not private"):
        private_dir(shared, "socket directory")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_intents_round_trip(tmp_path: Path) -> None:
    m = intents.record(tmp_path, "dataset", "app", "d.1")
    assert intents.pending(tmp_path) == [(m, "dataset", ("app", "d.1"))]
    intents.clear(m)
    assert intents.pending(tmp_path) == []


def test_revoked_app_stores_nothing_and_registers_again_after_forget(db: Database) -> None:
    apps, samples = AppRepo(db), SampleRepo(db)
    apps.create("a", "A", hash_token("t1"), Q)
    samples.append("a", "ds", [SampleBody(text="x")], Q)
    apps.revoke("a")
    with pytest.raises(Unauthenticated):
        samples.append("a", "ds", [SampleBody(text="y")], Q)
    with pytest.raises(FailedPrecondition, match="revoked"):
        apps.rotate("a", hash_token("t2"))
    with pytest.raises(AlreadyExists, match="forget it first"):
        apps.create("a", "A", hash_token("t2"), Q)
    with db.tx() as c:  # what ForgetApp leaves: the app row only
        c.execute("DELETE FROM samples WHERE app_id='a'")
        c.execute("DELETE FROM datasets WHERE app_id='a'")
    again = apps.create("a", "A2", hash_token("t2"), Q)
    assert not again.revoked and apps.app_for_token_hash(hash_token("t2")) == "a"
    apps.rotate("a", hash_token("t3"))
    assert apps.app_for_token_hash(hash_token("t2")) is None and apps.app_for_token_hash(hash_token("t3")) == "a"


def test_create_job_retry_is_answered_before_the_quota(db: Database) -> None:
    AppRepo(db).create("a", "A", hash_token("t"), Q)
    SampleRepo(db).append("a", "ds", [SampleBody(text="x")], Q)
    jobs = JobRepo(db)
    job, created = jobs.create("a", "r1", SPEC, JobState.WAITING, Blocked.NONE, 3, max_adapters=1)
    assert created
    with pytest.raises(ResourceExhausted, match="adapter quota"):
        jobs.create("a", "r2", SPEC, JobState.WAITING, Blocked.NONE, 3, max_adapters=1)
    assert jobs.find_request("a", "r1", SPEC) == job
    assert AdapterRepo(db).count("a") == 0


def test_sample_count_is_bounded_before_parsing() -> None:
    from lorad.server.rpc.wire import TooMany, count_exceeds, lenient
    from lorad.v1 import data_pb2

    many = data_pb2.AppendSamplesRequest(dataset_id="d", samples=[common_pb2.Sample(text="a")] * 1001)
    ok = data_pb2.AppendSamplesRequest(dataset_id="d", samples=[common_pb2.Sample(text="a")] * 1000)
    assert count_exceeds(many.SerializeToString(), 2, 1000)
    assert not count_exceeds(ok.SerializeToString(), 2, 1000)
    parse = lenient(data_pb2.AppendSamplesRequest.FromString, data_pb2.AppendSamplesRequest.DESCRIPTOR)
    assert parse(many.SerializeToString()) == TooMany("samples", 1000)
    assert len(parse(ok.SerializeToString()).samples) == 1000


def test_tokens_never_begin_with_a_dash(monkeypatch) -> None:
    """One URL-safe token in 64 began with "-", which `lorad --token -x…` reads as an option."""
    drawn = iter(["-" + "a" * 42, "--" + "b" * 41, "c" * 43])
    monkeypatch.setattr(auth.secrets, "token_urlsafe", lambda n: next(drawn))
    assert auth.new_token() == "c" * 43
