"""The AsyncClient against the daemon test double: the same results, errors and retries as the blocking client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import lorad.client as lc
from lorad.v1 import jobs_pb2
from tests.fixtures.fake_daemon import FAST_RETRY, OWNER_TOKEN, FakeDaemon


def test_async_end_to_end(fake: FakeDaemon, tmp_path: Path) -> None:
    async def main() -> None:
        async with lc.AsyncClient(fake.target, OWNER_TOKEN, retry=FAST_RETRY) as owner:
            token = (await owner.register_app("notes")).token
        async with lc.AsyncClient(fake.target, token, retry=FAST_RETRY) as c:
            r = await c.append_samples("diary", ["one", "two"])
            assert r.accepted_count == 2
            fake.state.fail_next["CreateJob"] = 1
            job = await c.create_job(["diary"], window=lc.TrainingWindow("30 2 * * *"))
            assert job.window == lc.TrainingWindow("30 2 * * *")
            fake.call(fake.jobs.add_event, job.job_id, jobs_pb2.JOB_STATE_RUNNING, 1, 2, 1.5)
            fake.call(fake.jobs.add_event, job.job_id, jobs_pb2.JOB_STATE_SUCCEEDED, 2, 2, 1.0)
            fake.state.watch_cut_after_events = [1]
            updates = [u async for u in c.watch(job)]
            assert [u.event.event_id for u in updates] == [1, 2, 3]
            assert updates[-1].job.state is lc.JobState.SUCCEEDED
            fake.state.download_cut_after_chunks = [2]
            d = await c.download_adapter(updates[-1].job, tmp_path / "a.tar")
            assert Path(d.path).read_bytes() == fake.state.adapter_blob
            assert await c.generate_text("hi", adapter=updates[-1].job) == f"echo[ad_{job.job_id}]: hi"
            with pytest.raises(lc.NotFound):
                await c.get_job("job_nope")

    asyncio.run(main())


def test_async_errors_map_like_sync(fake: FakeDaemon) -> None:
    async def main() -> None:
        async with lc.AsyncClient(fake.target, fake.app_token("a"), retry=FAST_RETRY) as c:
            with pytest.raises(lc.InvalidArgument) as ei:
                await c.create_job([])
            assert ei.value.field == "dataset_ids"
            with pytest.raises(lc.PermissionDenied):
                await c.list_apps()

    asyncio.run(main())


def test_async_stream_can_be_abandoned_early(fake: FakeDaemon) -> None:
    async def main() -> None:
        async with lc.AsyncClient(fake.target, fake.app_token("a"), retry=FAST_RETRY) as c:
            job = await c.create_job(["d"])  # never finishes: the watch must be closable
            agen = c.watch(job)
            first = await agen.__anext__()
            assert first.event.state is lc.JobState.QUEUED
            await agen.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))
