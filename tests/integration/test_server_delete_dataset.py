"""DeleteDataset with delete_adapters: the adapters that learned from the data go, down the init_adapter line; the
others stay; an interrupted deletion finishes at the next start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lorad.server import intents
from lorad.server.forget import DATASET_AND_ADAPTERS, resume_pending
from lorad.v1 import adapters_pb2, data_pb2, inference_pb2, jobs_pb2
from tests.integration.helpers import FINAL, append, create_job, wait_state

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
    learned = _train(app, "r1", "diary")
    s = d.daemon.services
    # What a kill -9 after the intent was recorded leaves: the marker, and everything still in place.
    intents.record(s.layout.data_dir, DATASET_AND_ADAPTERS, "notes-app", "diary")
    assert resume_pending(s) == 1
    assert _adapters(app) == set() and not s.layout.adapter_dir("notes-app", learned).exists()
    datasets = app.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=app.md).datasets
    assert [x.dataset_id for x in datasets] == []
    assert intents.pending(s.layout.data_dir) == []
