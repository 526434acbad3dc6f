"""DeleteDataset with delete_adapters: the adapters that learned from the data go, down the init_adapter line, and
so do the checkpoints of the jobs and the schedules that start from them; the others stay; an interrupted deletion
finishes at the next start. DeleteAdapter names or cancels the jobs and schedules that start from the adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorad.server import intents
from lorad.server.forget import DATASET_AND_ADAPTERS, resume_pending
from lorad.server.jobs.files import remove_tree
from lorad.v1 import adapters_pb2, common_pb2, data_pb2, inference_pb2, jobs_pb2
from tests.integration.helpers import FINAL, GOOD_PROBE, append, code_of, create_job, tiny_config, wait_state

pytestmark = pytest.mark.integration


def _train(app: Any, rid: str, dataset: str, init: str = "") -> str:
    job = create_job(app, rid, (dataset,), steps=2, init_adapter_id=init)
    done = wait_state(app, job.job_id, FINAL, 180)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.message
    return done.adapter_id


def _adapters(app: Any) -> set[str]:
    listed = app.adapters.ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=app.md).adapters
    return {a.adapter_id for a in listed}


def test_deleting_a_dataset_with_its_adapters(make_daemon: Any) -> None:
    d = make_daemon()
    app, _ = d.register("notes-app")
    stored = {ds: append(app, ds).accepted_count for ds in ("diary", "mail", "kept")}
    learned = _train(app, "r1", "diary")
    on_top = _train(app, "r2", "mail", init=learned)  # trained on from an adapter that learned the diary
    other = _train(app, "r3", "mail")
    kept = _train(app, "r4", "kept")
    s = d.daemon.services
    dirs = {a: s.layout.adapter_dir("notes-app", a) for a in (learned, on_top, other, kept)}
    assert all(p.is_dir() for p in dirs.values())

    r = app.data.DeleteDataset(data_pb2.DeleteDatasetRequest(dataset_id="kept"), metadata=app.md)
    assert (r.deleted_samples, r.deleted_adapters) == (stored["kept"], 0)
    assert _adapters(app) == {learned, on_top, other, kept}, "without delete_adapters the adapters stay"

    held = _generated_with(app, d, learned, other)  # their weights are now held in the daemon's memory
    r = app.data.DeleteDataset(data_pb2.DeleteDatasetRequest(dataset_id="diary", delete_adapters=True), metadata=app.md)
    assert (r.deleted_samples, r.deleted_adapters) == (stored["diary"], 2)
    assert _adapters(app) == {other, kept}
    assert not dirs[learned].exists() and not dirs[on_top].exists()
    assert dirs[other].is_dir() and dirs[kept].is_dir()
    jobs = app.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=app.md).jobs
    assert len(jobs) == 4, "the job records stay (their checkpoints of the data are gone)"
    assert set(held) == {other}, "a deleted adapter's weights do not stay in memory"
    app.adapters.DeleteAdapter(adapters_pb2.DeleteAdapterRequest(adapter_id=other), metadata=app.md)
    assert set(held) == set()


def test_jobs_and_schedules_that_start_from_a_deleted_adapter_are_dependents(make_daemon: Any) -> None:
    d = make_daemon()
    app, _ = d.register("notes-app")
    for ds in ("diary", "mail"):
        append(app, ds)
    learned = _train(app, "r1", "diary")
    d.set_probe({**GOOD_PROBE, "charging": False, "battery_percent": 20})  # the next job waits
    on_top = create_job(app, "r2", ("mail",), steps=2, init_adapter_id=learned)
    assert wait_state(app, on_top.job_id, {jobs_pb2.JOB_STATE_WAITING}).state == jobs_pb2.JOB_STATE_WAITING
    win = common_pb2.TrainingWindow(cron="30 2 * * *")
    sched = app.jobs.CreateSchedule(jobs_pb2.CreateScheduleRequest(
        dataset_ids=["mail"], window=win, config=tiny_config(steps=2, init_adapter_id=learned)), metadata=app.md
    ).schedule  # fmt: skip
    s = d.daemon.services
    work = s.layout.job_dir("notes-app", on_top.job_id)
    work.mkdir(parents=True, exist_ok=True)  # what a paused job keeps: its checkpoints of the adapter's weights
    (work / "checkpoint").write_bytes(b"x")

    req = data_pb2.DeleteDatasetRequest(dataset_id="diary", delete_adapters=True)
    code, msg, _ = code_of(lambda: app.data.DeleteDataset(req, metadata=app.md))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert on_top.job_id in msg and sched.schedule_id in msg, msg
    assert _adapters(app) == {learned} and work.is_dir(), "a refused deletion deletes nothing"

    plain = data_pb2.DeleteDatasetRequest(dataset_id="mail", cancel_dependents=False)
    assert code_of(lambda: app.data.DeleteDataset(plain, metadata=app.md))[0] == grpc.StatusCode.FAILED_PRECONDITION

    req.cancel_dependents = True
    r = app.data.DeleteDataset(req, metadata=app.md)
    assert r.deleted_adapters == 1 and _adapters(app) == set()
    job = app.jobs.GetJob(jobs_pb2.GetJobRequest(job_id=on_top.job_id), metadata=app.md).job
    assert job.state == jobs_pb2.JOB_STATE_CANCELLED
    events = app.jobs.ListJobEvents(jobs_pb2.ListJobEventsRequest(job_id=on_top.job_id), metadata=app.md).events
    assert learned in events[-1].message and "diary" in events[-1].message, events[-1].message
    assert not work.exists(), "the checkpoints of a job that started from the adapter are gone"
    assert list(app.jobs.ListSchedules(jobs_pb2.ListSchedulesRequest(), metadata=app.md).schedules) == []
    datasets = app.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=app.md).datasets
    assert [x.dataset_id for x in datasets] == ["mail"], "the other dataset the job read stays"


def _generated_with(app: Any, d: Any, *adapter_ids: str) -> dict[str, Any]:
    """Runs a short Generate with each adapter; returns the daemon's in-memory adapter weights (by adapter id)."""
    for a in adapter_ids:
        list(app.inference.Generate(inference_pb2.GenerateRequest(adapter_id=a, text="hi", max_tokens=2),
                                    metadata=app.md))  # fmt: skip
    gen = next(h.__self__ for h in d.daemon.services.on_adapters_deleted)  # the inference servicer's Generator
    assert set(gen._adapters) >= set(adapter_ids)
    return gen._adapters


def test_an_interrupted_deletion_with_adapters_finishes_at_start(make_daemon: Any, tmp_path: Path) -> None:
    d = make_daemon()
    app, _ = d.register("notes-app")
    append(app, "diary")
    append(app, "mail")
    learned = _train(app, "r1", "diary")
    on_top = _train(app, "r2", "mail", init=learned)
    s = d.daemon.services
    # What a kill -9 after the intent was recorded and the first adapter went leaves: the marker, and the rest.
    intents.record(s.layout.data_dir, DATASET_AND_ADAPTERS, "notes-app", "diary")
    remove_tree(s.layout.adapter_dir("notes-app", learned))
    s.adapters.delete("notes-app", learned)
    assert resume_pending(s) == 1
    assert _adapters(app) == set(), "the line is found from the job rows, not from the adapters still there"
    assert not s.layout.adapter_dir("notes-app", on_top).exists()
    datasets = app.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=app.md).datasets
    assert [x.dataset_id for x in datasets] == ["mail"]
    assert intents.pending(s.layout.data_dir) == []


def test_delete_adapter_names_or_cancels_what_starts_from_it(make_daemon: Any, tmp_path: Path) -> None:
    d = make_daemon()
    app, token = d.register("notes-app")
    append(app, "diary")
    learned = _train(app, "r1", "diary")
    finished = _train(app, "r2", "diary", init=learned)  # trained on from it, done: stays
    d.set_probe({**GOOD_PROBE, "charging": False, "battery_percent": 20})  # the next job waits
    waiting = create_job(app, "r3", ("diary",), steps=2, init_adapter_id=learned)
    assert wait_state(app, waiting.job_id, {jobs_pb2.JOB_STATE_WAITING}).state == jobs_pb2.JOB_STATE_WAITING
    sched = app.jobs.CreateSchedule(jobs_pb2.CreateScheduleRequest(
        dataset_ids=["diary"], window=common_pb2.TrainingWindow(cron="30 2 * * *"),
        config=tiny_config(steps=2, init_adapter_id=learned)), metadata=app.md).schedule  # fmt: skip

    req = adapters_pb2.DeleteAdapterRequest(adapter_id=learned)
    code, msg, _ = code_of(lambda: app.adapters.DeleteAdapter(req, metadata=app.md))
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, msg)
    assert waiting.job_id in msg and sched.schedule_id in msg and "cancel_dependents" in msg, msg
    assert _adapters(app) == {learned, finished}, "a refused deletion deletes nothing"

    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env |= {"HOME": str(tmp_path), "LORAD_CLIENT_CONFIG": str(tmp_path / "client.toml"), "LORAD_TOKEN": token,
            "LORAD_TARGET": f"unix:{d.daemon.socket_path}"}  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "lorad.client.cli", "adapters", "delete", learned, "--yes",
                        "--cancel-dependents", "--json"], check=False, capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["deleted"] == learned
    assert _adapters(app) == {finished}
    job = app.jobs.GetJob(jobs_pb2.GetJobRequest(job_id=waiting.job_id), metadata=app.md).job
    assert job.state == jobs_pb2.JOB_STATE_CANCELLED
    events = app.jobs.ListJobEvents(jobs_pb2.ListJobEventsRequest(job_id=waiting.job_id), metadata=app.md).events
    assert learned in events[-1].message, events[-1].message
    assert list(app.jobs.ListSchedules(jobs_pb2.ListSchedulesRequest(), metadata=app.md).schedules) == []
    code, msg, _ = code_of(lambda: create_job(app, "r4", ("diary",), steps=2, init_adapter_id=learned))
    assert code == grpc.StatusCode.NOT_FOUND and learned in msg, (code, msg)
