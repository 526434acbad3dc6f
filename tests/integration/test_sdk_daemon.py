"""The SDK against the REAL daemon (in-process, temp Unix socket, tiny random Llama): sync and async end to end."""

from __future__ import annotations

import asyncio
import hashlib
import tarfile
from pathlib import Path
from typing import Any

import pytest

import lorad.client as lc

pytestmark = pytest.mark.integration

FAST = lc.RetryPolicy(max_attempts=3, initial_backoff_seconds=0.01, max_backoff_seconds=0.05)
TINY = lc.TrainingConfig(
    max_steps=4, seq_len=64, batch_size=2, learning_rate=1e-3, eval_every_steps=2, checkpoint_every_steps=2,
    eval_fraction=0.3, seed=7, lora=lc.LoraConfig(rank=4),
)  # fmt: skip
SAMPLES: list[Any] = [
    {"messages": [{"role": "user", "content": f"What is note {i}?"}, {"role": "assistant", "content": f"Fox {i}."}]}
    for i in range(12)
] + [f"The lazy dog sleeps, day {i}." for i in range(6)]


def test_sync_end_to_end_against_real_daemon(make_daemon: Any, tmp_path: Path) -> None:
    h = make_daemon()
    target = str(h.daemon.socket_path)
    with lc.Client.for_owner(h.data_dir, target=target, retry=FAST) as owner:
        reg = owner.register_app("notes", "Notes")
        assert [a.app_id for a in owner.list_apps()] == ["notes"]
        with pytest.raises(lc.AlreadyExists):
            owner.register_app("notes")
    with lc.Client(target, reg.token, retry=FAST, timeout=30) as c:
        r = c.append_samples("diary", SAMPLES)
        assert r.accepted_count == len(SAMPLES) and r.dataset is not None
        assert c.append_samples("diary", SAMPLES[:3]).duplicate_count == 3
        with pytest.raises(lc.PermissionDenied):
            c.list_apps()
        with pytest.raises(lc.InvalidArgument) as ei:
            c.append_samples("diary", [{"messages": [{"role": "user", "content": ""}]}])
        assert ei.value.field.startswith("samples[0]")
        job = c.create_job(["diary"], TINY, requirements=lc.DeviceRequirements(require_charging=True))
        again = c.create_job(["diary"], TINY, requirements=lc.DeviceRequirements(require_charging=True),
                             request_id=job.request_id)  # fmt: skip
        assert again.job_id == job.job_id
        updates = list(c.watch(job))
        ids = [u.event.event_id for u in updates]
        assert ids == sorted(set(ids)) and updates[-1].job.state is lc.JobState.SUCCEEDED
        assert any(u.event.kind is lc.JobEventKind.PROGRESS for u in updates)
        # Resuming a watch after the last event id yields nothing new and ends (the job is final).
        assert list(c.watch(job, after_event_id=ids[-1])) == []
        done = c.get_job(job)
        assert done.adapter_id and done.progress.step == 4
        with pytest.raises(lc.FailedPrecondition):
            c.pause_job(done)
        with pytest.raises(lc.NotFound):
            c.get_job("job_does_not_exist")
        res = c.download_adapter(done, tmp_path, "peft")
        blob = Path(res.path).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == res.sha256 and len(blob) == res.size_bytes
        with tarfile.open(res.path) as tar:
            names = tar.getnames()
        assert any(n.endswith("adapter_config.json") for n in names)
        assert any(n.endswith("adapter_model.safetensors") for n in names)
        text = c.generate_text("What is note 3?", adapter=done, max_tokens=8)
        assert isinstance(text, str)
        chunks = list(c.generate("hello", raw=True, max_tokens=5))
        assert chunks and chunks[-1].finish_reason is not None and chunks[-1].token_count <= 5
        assert [a.adapter_id for a in c.list_adapters()] == [done.adapter_id]
        status = c.device_status()
        assert status.readings.charging is True and status.can_train


def test_async_download_resumes_from_part_file_on_real_daemon(make_daemon: Any, tmp_path: Path) -> None:
    h = make_daemon()
    target = str(h.daemon.socket_path)

    async def main() -> None:
        async with lc.AsyncClient(target, h.owner_token, retry=FAST) as owner:
            token = (await owner.register_app("a")).token
        async with lc.AsyncClient(target, token, retry=FAST, timeout=30) as c:
            await c.append_samples("d", SAMPLES)
            job = await c.create_job(["d"], TINY)
            final = [u async for u in c.watch(job)][-1].job
            assert final.state is lc.JobState.SUCCEEDED, final.error
            whole = await c.download_adapter(final, tmp_path / "whole.tar")
            data = Path(whole.path).read_bytes()
            # A previous process got 40% of the file before dying: the next call resumes from there.
            part = tmp_path / "resumed.tar.part"
            part.write_bytes(data[: len(data) * 2 // 5])
            resumed = await c.download_adapter(final, tmp_path / "resumed.tar")
            assert resumed.resumed_from == len(data) * 2 // 5 and resumed.sha256 == whole.sha256
            assert Path(resumed.path).read_bytes() == data and not part.exists()

    asyncio.run(main())


def test_unavailable_daemon_is_retried_then_reported(tmp_path: Path) -> None:
    with lc.Client(str(tmp_path / "gone.sock"), "t", retry=FAST) as c, pytest.raises(lc.Unavailable) as ei:
        c.list_jobs()
    assert "lorad serve" in str(ei.value)
