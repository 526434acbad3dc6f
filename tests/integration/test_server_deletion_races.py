"""Writes racing a deletion of the same data (a real daemon over gRPC): while DeleteDataset or ForgetApp runs, the
writes it would miss are refused with ABORTED naming it, the others go on, and nothing written meanwhile outlives it.
A reader job that finishes just as the deletion starts loses its adapter too.

Each test holds the deletion at its first step (stopping the jobs on the data) so the racing calls land inside it."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from lorad.client.federated.lora import peft_tar
from lorad.server.errors import NotFound
from lorad.server.records import JobState
from lorad.v1 import adapters_pb2, common_pb2, data_pb2, jobs_pb2
from tests.integration.helpers import (
    FINAL,
    GOOD_PROBE,
    append,
    code_of,
    create_job,
    tiny_config,
    wait_for,
    wait_state,
)

pytestmark = pytest.mark.integration


def _adapters(app: Any) -> set[str]:
    listed = app.adapters.ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=app.md).adapters
    return {a.adapter_id for a in listed}


def _hold_deletions(d: Any, before: Callable[[], None] | None = None) -> tuple[threading.Event, threading.Event]:
    """Makes the daemon's deletions stop at their first job stop: returns (entered, go)."""
    runner = d.daemon.services.runner
    real = runner.stop_for_purge
    entered, go = threading.Event(), threading.Event()

    def held(*args: Any, **kw: Any) -> bool:
        entered.set()
        if before is not None:
            before()
        assert go.wait(60), "the test never let the deletion go on"
        return real(*args, **kw)

    runner.stop_for_purge = held
    return entered, go


def _trained(app: Any, rid: str, dataset: str) -> str:
    job = create_job(app, rid, (dataset,), steps=2)
    done = wait_state(app, job.job_id, FINAL, 180)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.message
    return done.adapter_id


def test_writes_racing_delete_dataset_are_refused_and_nothing_outlives_it(make_daemon: Any) -> None:
    d = make_daemon()
    app, _ = d.register("notes-app")
    other, _ = d.register("other-app")
    append(app, "diary")
    append(app, "mail")
    learned = _trained(app, "r1", "diary")
    entered, go = _hold_deletions(d)
    req = data_pb2.DeleteDatasetRequest(dataset_id="diary", delete_adapters=True)
    deleting = app.data.DeleteDataset.future(req, metadata=app.md)
    assert entered.wait(30)

    code, msg, _ = code_of(lambda: append(app, "diary"))
    assert code == grpc.StatusCode.ABORTED and "'diary' is being deleted" in msg, (code, msg)
    assert append(app, "mail").duplicate_count > 0, "another dataset of the app takes samples meanwhile"
    assert append(other, "diary").accepted_count > 0, "so does another app's dataset of the same name"

    def nightly(dataset: str) -> jobs_pb2.CreateScheduleRequest:
        win = common_pb2.TrainingWindow(cron="30 2 * * *")
        return jobs_pb2.CreateScheduleRequest(dataset_ids=[dataset], window=win, config=tiny_config(steps=2))

    for make in (
        lambda: create_job(app, "r2", ("mail",), steps=2, init_adapter_id=learned),  # from an adapter of the line
        lambda: create_job(app, "r3", ("diary",), steps=2),  # reading it
        lambda: app.jobs.CreateSchedule(nightly("diary"), metadata=app.md),
    ):
        code, msg, _ = code_of(make)
        assert code == grpc.StatusCode.ABORTED and "'diary'" in msg, (code, msg)
    # Neither reading the dataset nor starting from an adapter: goes on.
    kept = app.jobs.CreateSchedule(nightly("mail"), metadata=app.md).schedule

    go.set()
    r = deleting.result(timeout=120)
    assert (r.deleted_adapters, _adapters(app)) == (1, set())
    datasets = app.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=app.md).datasets
    assert sorted(x.dataset_id for x in datasets) == ["mail"], "no sample appended mid-deletion was kept"
    assert len(app.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=app.md).jobs) == 1
    scheds = app.jobs.ListSchedules(jobs_pb2.ListSchedulesRequest(), metadata=app.md).schedules
    assert [x.schedule_id for x in scheds] == [kept.schedule_id]
    assert append(app, "diary").accepted_count > 0, "once it returned, the name starts a new dataset"
    app.jobs.CreateSchedule(nightly("diary"), metadata=app.md)  # and jobs on it may be created again


def test_writes_racing_forget_app_are_refused(make_daemon: Any) -> None:
    d = make_daemon()
    app, _ = d.register("notes-app")
    other, _ = d.register("other-app")
    append(app, "diary")
    entered, go = _hold_deletions(d)
    forgetting = app.data.ForgetApp.future(data_pb2.ForgetAppRequest(), metadata=app.md)
    assert entered.wait(30)
    for make in (lambda: append(app, "mail"), lambda: create_job(app, "r1", ("diary",), steps=2)):
        code, msg, _ = code_of(make)
        assert code == grpc.StatusCode.ABORTED and "'notes-app' is being forgotten" in msg, (code, msg)
    assert append(other, "diary").accepted_count > 0
    go.set()
    assert forgetting.result(timeout=120).deleted_samples > 0
    assert not app.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=app.md).datasets
    assert not app.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=app.md).jobs


def test_a_reader_finishing_as_the_deletion_starts_loses_its_adapter_too(make_daemon: Any) -> None:
    d = make_daemon()
    app, _ = d.register("notes-app")
    append(app, "diary")
    d.set_probe({**GOOD_PROBE, "charging": False, "battery_percent": 20})  # the job waits for the conditions
    job = create_job(app, "r1", ("diary",), steps=2)
    assert wait_state(app, job.job_id, {jobs_pb2.JOB_STATE_WAITING}).state == jobs_pb2.JOB_STATE_WAITING
    s = d.daemon.services

    def finish_the_job() -> None:  # after the deletion read which jobs learned from the data, before it stops them
        d.set_probe(GOOD_PROBE)
        wait_for(lambda: s.jobs.get(job.job_id).state is JobState.SUCCEEDED, 180, "the job to finish")

    _, go = _hold_deletions(d, before=finish_the_job)
    go.set()
    req = data_pb2.DeleteDatasetRequest(dataset_id="diary", delete_adapters=True, cancel_dependents=True)
    r = app.data.DeleteDataset(req, metadata=app.md, timeout=300)
    done = app.jobs.GetJob(jobs_pb2.GetJobRequest(job_id=job.job_id), metadata=app.md).job
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED and done.adapter_id
    assert (r.deleted_adapters, _adapters(app)) == (1, set()), "the adapter it trained on the data stayed"
    assert not s.layout.adapter_dir("notes-app", done.adapter_id).exists()


def test_an_import_racing_forget_app_is_refused(make_daemon: Any, tiny_llama: Path, tmp_path: Path) -> None:
    from tests.integration.test_server_federated_features import _global_adapter, _model_hash

    d = make_daemon()
    app, _ = d.register("fedapp")
    base_hash = _model_hash(tiny_llama, tmp_path / "hashcache")
    blob = peft_tar(*_global_adapter(tiny_llama, base_hash, np.random.default_rng(0)))
    header = adapters_pb2.ImportAdapterRequest(header=adapters_pb2.ImportAdapterHeader(
        base_model_sha256=base_hash, total_size_bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest()))  # fmt: skip
    uploads = d.data_dir / "apps" / "fedapp" / "imports"

    def forgotten_mid_upload() -> Iterator[adapters_pb2.ImportAdapterRequest]:
        yield header
        wait_for(lambda: list(uploads.glob(".tmp-*")), 30, "the upload to start")
        assert app.data.ForgetApp(data_pb2.ForgetAppRequest(), metadata=app.md).deleted_adapters == 0
        yield adapters_pb2.ImportAdapterRequest(chunk=blob)

    code, msg, _ = code_of(lambda: app.adapters.ImportAdapter(forgotten_mid_upload(), metadata=app.md))
    assert code == grpc.StatusCode.ABORTED and "forgotten while the adapter was uploading" in msg, (code, msg)

    entered, go = _hold_deletions(d)
    forgetting = app.data.ForgetApp.future(data_pb2.ForgetAppRequest(), metadata=app.md)
    assert entered.wait(30)
    code, msg, _ = code_of(lambda: app.adapters.ImportAdapter(iter([header, adapters_pb2.ImportAdapterRequest(
        chunk=blob)]), metadata=app.md))  # fmt: skip
    assert code == grpc.StatusCode.ABORTED and "'fedapp' is being forgotten" in msg, (code, msg)
    go.set()
    forgetting.result(timeout=120)
    assert not _adapters(app)
    assert app.adapters.ImportAdapter(iter([header, adapters_pb2.ImportAdapterRequest(chunk=blob)]),
                                      metadata=app.md).adapter.adapter_id  # fmt: skip


def test_a_schedule_firing_during_a_deletion_creates_its_job_once_the_deletion_ends(make_daemon: Any) -> None:
    d = make_daemon()
    app, _ = d.register("notes-app")
    append(app, "diary")
    append(app, "mail")
    _trained(app, "r1", "diary")  # a reader: the deletion stops it first, where the test holds it
    on_mail = _trained(app, "r2", "mail")
    nightly = jobs_pb2.CreateScheduleRequest(
        dataset_ids=["mail"], window=common_pb2.TrainingWindow(cron="30 2 * * *"),
        config=tiny_config(steps=2, init_adapter_id=on_mail),
    )  # fmt: skip
    sched = app.jobs.CreateSchedule(nightly, metadata=app.md).schedule  # from an adapter: waits for such a deletion
    entered, go = _hold_deletions(d)
    req = data_pb2.DeleteDatasetRequest(dataset_id="diary", delete_adapters=True)
    deleting = app.data.DeleteDataset.future(req, metadata=app.md)
    assert entered.wait(30)
    d.daemon.scheduler.on_fire("schedule", sched.schedule_id)  # returns at once: it asks again from a timer

    def scheduled() -> list[str]:
        jobs = app.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=app.md).jobs
        return [j.schedule_id for j in jobs if j.schedule_id]

    time.sleep(1.5)
    assert scheduled() == [], "a job reading mail was created during the deletion of diary"
    go.set()
    deleting.result(timeout=120)
    assert wait_for(scheduled, 30, "the night's job") == [sched.schedule_id]
    time.sleep(1.5)
    assert scheduled() == [sched.schedule_id], "the firing created more than one job"


def test_no_export_is_built_for_an_adapter_being_or_already_deleted(make_daemon: Any) -> None:
    d = make_daemon()
    app, _ = d.register("notes-app")
    append(app, "diary")
    adapter = _trained(app, "r1", "diary")
    s = d.daemon.services
    rec = s.library.get("notes-app", adapter)
    pull = adapters_pb2.DownloadAdapterRequest(adapter_id=adapter, format=adapters_pb2.ADAPTER_FORMAT_GGUF)
    entered, go = _hold_deletions(d)
    forgetting = app.data.ForgetApp.future(data_pb2.ForgetAppRequest(), metadata=app.md)
    assert entered.wait(30)
    code, msg, _ = code_of(lambda: list(app.adapters.DownloadAdapter(pull, metadata=app.md)))
    assert code == grpc.StatusCode.ABORTED and "being forgotten" in msg, (code, msg)
    go.set()
    forgetting.result(timeout=120)
    folder = s.layout.adapter_dir("notes-app", adapter)
    assert not folder.exists()
    # A download that read the adapter's record before the deletion and builds after it: nothing is recreated.
    with pytest.raises(NotFound):
        s.library.export(rec, "gguf")
    assert not folder.exists(), "an export rebuilt the deleted adapter's folder"
