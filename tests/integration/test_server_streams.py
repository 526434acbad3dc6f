"""Server streams that the client abandons end cleanly: no asyncio 'Task exception was never retrieved' in the logs."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

from lorad.v1 import adapters_pb2, jobs_pb2
from tests.integration.helpers import append, create_job, wait_state

pytestmark = pytest.mark.integration


def _collect_on_loop(d) -> None:  # type: ignore[no-untyped-def]
    """Runs the garbage collector on the daemon's loop (abandoned async generators are finalised there)."""

    async def collect() -> None:
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.05)

    asyncio.run_coroutine_threadsafe(collect(), d.loop).result(10)


def test_abandoned_streams_leave_no_task_errors(make_daemon, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    d = make_daemon()
    app, _ = d.register("notes")
    append(app)
    job = create_job(app, steps=4, checkpoint_every_steps=1, eval_every_steps=1)
    done = wait_state(app, job.job_id, {jobs_pb2.JOB_STATE_SUCCEEDED}, 90)
    for _ in range(3):
        # Read one message of a longer stream, then cancel: the server's generator stops mid-stream.
        watch = app.jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=job.job_id), metadata=app.md, timeout=30)
        next(watch)
        watch.cancel()
        dl = app.adapters.DownloadAdapter(
            adapters_pb2.DownloadAdapterRequest(adapter_id=done.adapter_id),
            metadata=app.md, timeout=30,
        )  # fmt: skip
        next(dl)
        dl.cancel()
    # A full stream still ends normally after the abandoned ones.
    events = list(app.jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=job.job_id), metadata=app.md, timeout=30))
    assert events[-1].event.state == jobs_pb2.JOB_STATE_SUCCEEDED
    time.sleep(0.3)
    _collect_on_loop(d)
    time.sleep(0.2)
    bad = [r.getMessage() + str(r.exc_info or "") for r in caplog.records if r.name == "asyncio"]
    assert not bad, bad
