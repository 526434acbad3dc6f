"""Store: WAL + migrations, atomic appends, idempotent job creation, transitions with events, UTF-8 field paths."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from lorad.server.auth import Authenticator, ensure_owner_token, hash_token
from lorad.server.engine.training.config import job_config
from lorad.server.errors import AlreadyExists, FailedPrecondition, NotFound, ResourceExhausted, Unauthenticated
from lorad.server.records import Blocked, JobSpec, JobState, Quota, Requirements, SampleBody
from lorad.server.rpc.wire import bad_utf8_path
from lorad.server.store import AppRepo, Database, JobRepo, SampleRepo
from lorad.v1 import data_pb2

Q = Quota(max_samples=5, max_sample_bytes=1000, max_adapters=2, max_active_jobs=1)
SPEC = JobSpec(("ds",), job_config({"steps": 3}), Requirements(True, 50, 40.0, False))


@pytest.fixture
def db(tmp_path: Path) -> Database:
    return Database(tmp_path / "s.sqlite")


def test_wal_and_migrations_are_idempotent(tmp_path: Path, db: Database) -> None:
    assert db.schema_version == 1
    db.close()
    again = Database(tmp_path / "s.sqlite")
    assert again.schema_version == 1
    mode = sqlite3.connect(tmp_path / "s.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_appends_are_atomic_with_quotas_and_duplicates(db: Database) -> None:
    AppRepo(db).create("a", "A", hash_token("t"), Q)
    s = SampleRepo(db)
    r = s.append("a", "ds", [SampleBody(text="x"), SampleBody(text="y"), SampleBody(text="x")], Q)
    assert (r.accepted, r.duplicates, r.dataset.sample_count) == (2, 1, 2)
    with pytest.raises(ResourceExhausted, match="max_samples=5"):
        s.append("a", "ds", [SampleBody(text=str(i)) for i in range(4)], Q)
    assert s.get_dataset("a", "ds").sample_count == 2  # all or nothing
    with pytest.raises(ResourceExhausted, match="max_sample_bytes"):
        s.append("a", "ds", [SampleBody(text="z" * 999)], Q)
    with pytest.raises(NotFound):
        s.get_dataset("b", "ds")
    assert [b.text for b in s.training_samples("a", ["ds"], 2**62)] == ["x", "y"]


def test_jobs_idempotency_transitions_and_events(db: Database) -> None:
    AppRepo(db).create("a", "A", hash_token("t"), Q)
    jobs = JobRepo(db)
    job, created = jobs.create("a", "r1", SPEC, JobState.WAITING, Blocked.NONE, max_active=1)
    assert created
    same, created = jobs.create("a", "r1", SPEC, JobState.WAITING, Blocked.NONE, max_active=1)
    assert not created and same.job_id == job.job_id
    with pytest.raises(AlreadyExists):
        jobs.create("a", "r1", JobSpec(("ds",), job_config({"steps": 4}), SPEC.requirements), JobState.WAITING,
                    Blocked.NONE, max_active=1)  # fmt: skip
    with pytest.raises(ResourceExhausted):
        jobs.create("a", "r2", SPEC, JobState.WAITING, Blocked.NONE, max_active=1)
    with pytest.raises(NotFound):
        jobs.get(job.job_id, app_id="other")
    j, ev = jobs.transition(job.job_id, (JobState.WAITING,), JobState.RUNNING)
    assert j.state is JobState.RUNNING and j.started_at_ms > 0 and ev is not None
    with pytest.raises(FailedPrecondition, match="RUNNING"):
        jobs.transition(job.job_id, (JobState.PAUSED,), JobState.WAITING)
    events, more = jobs.events(job.job_id, 0, 1)
    assert len(events) == 1 and more
    events, more = jobs.events(job.job_id, events[0].event_id, 10)
    assert [e.state for e in events] == [JobState.RUNNING] and not more


def test_owner_token_and_authenticator(tmp_path: Path, db: Database) -> None:
    token = ensure_owner_token(tmp_path / "d")
    assert (tmp_path / "d" / "owner.token").stat().st_mode & 0o777 == 0o600
    assert ensure_owner_token(tmp_path / "d") == token
    apps = AppRepo(db)
    apps.create("a", "A", hash_token("app-token"), Q)
    auth = Authenticator(token, apps)
    assert auth.authenticate(f"Bearer {token}").is_owner
    assert auth.authenticate("Bearer app-token").app_id == "a"
    apps.revoke("a")
    with pytest.raises(Unauthenticated):
        auth.authenticate("Bearer app-token")
    with pytest.raises(Unauthenticated):
        auth.authenticate(None)


def test_bad_utf8_path_names_the_nested_field() -> None:
    good = data_pb2.AppendSamplesRequest(dataset_id="d")
    s = good.samples.add()
    s.chat.messages.add(role=2, content="ok")
    s.chat.messages.add(role=3, content="PLACEHOLDER")
    raw = good.SerializeToString().replace(b"PLACEHOLDER", b"\xffPLACEHOLD\xfe")
    assert bad_utf8_path(raw, data_pb2.AppendSamplesRequest.DESCRIPTOR) == "samples[0].chat.messages[1].content"
    assert bad_utf8_path(good.SerializeToString(), data_pb2.AppendSamplesRequest.DESCRIPTOR) is None
