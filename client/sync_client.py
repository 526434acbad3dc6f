"""The blocking lorad client: the AsyncClient driven on a private event-loop thread, so behaviour is identical."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from lorad.client import types as t
from lorad.client._download import ProgressCallback
from lorad.client.async_client import AdapterRef, AsyncClient, JobRef
from lorad.client.config import ClientSettings, owner_token
from lorad.client.retry import RetryPolicy

T = TypeVar("T")


class _LoopThread:
    """One event loop on a daemon thread; blocking callers submit coroutines to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lorad-client-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt in the caller: stop the call on the loop too
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        async def next_item() -> tuple[bool, T | None]:
            try:
                return True, await agen.__anext__()
            except StopAsyncIteration:
                return False, None

        try:
            while True:
                ok, item = self.run(next_item())
                if not ok:
                    return
                yield item  # type: ignore[misc]
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and self.loop.is_running():
                self.run(aclose())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


class Client:
    """Blocking client of one lorad daemon; same arguments, results and errors as AsyncClient.

    Args:
        target: Socket path, "unix:..." or "host:port"; default LORAD_TARGET, client.toml, then the daemon's socket.
        token: App token (owner token for app management); default LORAD_TOKEN, then client.toml.
        timeout: Deadline of each unary call attempt, seconds.
        retry: Backoff policy for UNAVAILABLE.
        data_dir: The daemon's data directory, used to find its default socket.
    """

    def __init__(
        self,
        target: str | None = None,
        token: str | None = None,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        data_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._loop = _LoopThread()

        async def make() -> AsyncClient:
            return AsyncClient(target, token, timeout=timeout, retry=retry, data_dir=data_dir)

        try:
            self._aio = self._loop.run(make())
        except BaseException:
            self._loop.stop()
            raise

    @classmethod
    def for_owner(cls, data_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Client:
        """A client holding the device owner's token ($LORAD_OWNER_TOKEN or <data_dir>/owner.token)."""
        token, source = owner_token(data_dir)
        client = cls(token=token, data_dir=data_dir, **kwargs)
        client.token_source = source
        return client

    @property
    def settings(self) -> ClientSettings:
        """The resolved target, token and timeout."""
        return self._aio.settings

    @property
    def token_source(self) -> str:
        """Where the token came from, as error messages name it."""
        return self._aio.settings.token_source

    @token_source.setter
    def token_source(self, source: str) -> None:
        self._aio.settings = dataclasses.replace(self._aio.settings, token_source=source)

    def close(self) -> None:
        """Closes the channel and stops the loop thread."""
        if self._loop.loop.is_closed():
            return
        self._loop.run(self._aio.close())
        self._loop.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> t.DeviceStatus:
        """Waits until the daemon answers; see AsyncClient.wait_ready."""
        return self._loop.run(self._aio.wait_ready(timeout))

    # apps
    def register_app(self, app_id: str, display_name: str = "", quota: t.AppQuota | None = None) -> t.RegisteredApp:
        """Registers an app (owner only); see AsyncClient.register_app."""
        return self._loop.run(self._aio.register_app(app_id, display_name, quota))

    def list_apps(self) -> list[t.App]:
        """Lists registered apps (owner only)."""
        return self._loop.run(self._aio.list_apps())

    def revoke_app(self, app_id: str) -> None:
        """Revokes an app's token (owner only)."""
        self._loop.run(self._aio.revoke_app(app_id))

    def rotate_app_token(self, app_id: str) -> str:
        """Issues a new token for an app (owner only); the old one stops working at once."""
        return str(self._loop.run(self._aio.rotate_app_token(app_id)))

    # data
    def append_samples(self, dataset_id: str, samples: Iterable[t.Sample | str | dict[str, Any]]) -> t.AppendResult:
        """Appends samples in atomic batches; see AsyncClient.append_samples."""
        return self._loop.run(self._aio.append_samples(dataset_id, list(samples)))

    def list_datasets(self) -> list[t.Dataset]:
        """Lists the app's datasets."""
        return self._loop.run(self._aio.list_datasets())

    def get_dataset(self, dataset_id: str) -> t.Dataset:
        """Gets one dataset."""
        return self._loop.run(self._aio.get_dataset(dataset_id))

    def list_samples(self, dataset_id: str) -> list[t.StoredSample]:
        """Lists a dataset's samples."""
        return self._loop.run(self._aio.list_samples(dataset_id))

    def delete_dataset(
        self, dataset_id: str, cancel_dependents: bool = False, delete_adapters: bool = False
    ) -> t.DatasetDeleted:
        """Deletes a dataset (see the async client for ``cancel_dependents`` and ``delete_adapters``)."""
        return self._loop.run(self._aio.delete_dataset(dataset_id, cancel_dependents, delete_adapters))

    def forget_app(self, app_id: str = "") -> t.ForgetResult:
        """Deletes all of an app's data, jobs and adapters."""
        return self._loop.run(self._aio.forget_app(app_id))

    # jobs
    def create_job(
        self,
        dataset_ids: Sequence[str],
        config: t.TrainingConfig | None = None,
        *,
        requirements: t.DeviceRequirements | None = None,
        window: t.TrainingWindow | None = None,
        request_id: str | None = None,
    ) -> t.Job:
        """Creates a training job (idempotent on request_id); see AsyncClient.create_job."""
        return self._loop.run(
            self._aio.create_job(dataset_ids, config, requirements=requirements, window=window, request_id=request_id)
        )

    def get_job(self, job: JobRef) -> t.Job:
        """Gets one job."""
        return self._loop.run(self._aio.get_job(job))

    def list_jobs(self, states: Iterable[t.JobState] = ()) -> list[t.Job]:
        """Lists the app's jobs, newest first."""
        return self._loop.run(self._aio.list_jobs(list(states)))

    def pause_job(self, job: JobRef) -> t.Job:
        """Asks a job to pause."""
        return self._loop.run(self._aio.pause_job(job))

    def resume_job(self, job: JobRef) -> t.Job:
        """Resumes a paused job."""
        return self._loop.run(self._aio.resume_job(job))

    def cancel_job(self, job: JobRef) -> t.Job:
        """Cancels a job."""
        return self._loop.run(self._aio.cancel_job(job))

    def list_job_events(self, job: JobRef, after_event_id: int = 0) -> list[t.JobEvent]:
        """Lists a job's events after `after_event_id`."""
        return self._loop.run(self._aio.list_job_events(job, after_event_id))

    def list_checkpoints(self, job: JobRef) -> list[t.Checkpoint]:
        """Lists a job's checkpoints."""
        return self._loop.run(self._aio.list_checkpoints(job))

    def watch(self, job: JobRef, after_event_id: int = 0) -> Iterator[t.JobUpdate]:
        """Yields the job's events until it is final, reconnecting after a break; see AsyncClient.watch."""
        return self._loop.iterate(self._aio.watch(job, after_event_id))

    def create_schedule(
        self,
        dataset_ids: Sequence[str],
        window: t.TrainingWindow,
        config: t.TrainingConfig | None = None,
        *,
        requirements: t.DeviceRequirements | None = None,
    ) -> t.Schedule:
        """Creates a recurring schedule."""
        return self._loop.run(self._aio.create_schedule(dataset_ids, window, config, requirements=requirements))

    def list_schedules(self) -> list[t.Schedule]:
        """Lists the app's schedules."""
        return self._loop.run(self._aio.list_schedules())

    def delete_schedule(self, schedule_id: str) -> None:
        """Deletes a schedule."""
        self._loop.run(self._aio.delete_schedule(schedule_id))

    # adapters
    def list_adapters(self) -> list[t.Adapter]:
        """Lists the app's adapters, newest first."""
        return self._loop.run(self._aio.list_adapters())

    def adapter_id_of(self, adapter: AdapterRef) -> str:
        """The adapter id of an Adapter, a succeeded Job, a job id or an adapter id (see AsyncClient.adapter_id_of)."""
        return self._loop.run(self._aio.adapter_id_of(adapter))

    def get_adapter(self, adapter: AdapterRef) -> t.Adapter:
        """Gets one adapter by Adapter, adapter id, Job or job id."""
        return self._loop.run(self._aio.get_adapter(adapter))

    def import_adapter(self, peft_tar: bytes, base_model_sha256: str, base_model: str = "") -> t.Adapter:
        """Stores a PEFT adapter tar in the app's registry; see AsyncClient.import_adapter."""
        return self._loop.run(self._aio.import_adapter(peft_tar, base_model_sha256, base_model))

    def delete_adapter(self, adapter: AdapterRef, cancel_dependents: bool = False) -> int:
        """Deletes an adapter; returns the bytes freed (see the async client for ``cancel_dependents``)."""
        return self._loop.run(self._aio.delete_adapter(adapter, cancel_dependents))

    def download_adapter(
        self,
        adapter: AdapterRef,
        path: str | os.PathLike[str],
        format: t.AdapterFormat | str = t.AdapterFormat.PEFT,
        *,
        overwrite: bool = False,
        on_progress: ProgressCallback | None = None,
    ) -> t.DownloadResult:
        """Downloads, verifies and atomically places an adapter file; see AsyncClient.download_adapter."""
        return self._loop.run(
            self._aio.download_adapter(adapter, path, format, overwrite=overwrite, on_progress=on_progress)
        )

    # inference and device
    def generate(self, prompt: str | Sequence[t.ChatMessage], **kwargs: Any) -> Iterator[t.GenerateChunk]:
        """Streams generated text; keyword arguments as AsyncClient.generate."""
        return self._loop.iterate(self._aio.generate(prompt, **kwargs))

    def generate_text(self, prompt: str | Sequence[t.ChatMessage], **kwargs: Any) -> str:
        """Returns the whole generated text."""
        return self._loop.run(self._aio.generate_text(prompt, **kwargs))

    def disk_usage(self) -> t.DiskUsage:
        """Bytes on disk (see AsyncClient.disk_usage)."""
        return self._loop.run(self._aio.disk_usage())

    def collect_garbage(self) -> t.GarbageCollected:
        """Deletes rebuildable files (see AsyncClient.collect_garbage)."""
        return self._loop.run(self._aio.collect_garbage())

    def device_status(self) -> t.DeviceStatus:
        """Backend, device readings and what the app's current job waits for."""
        return self._loop.run(self._aio.device_status())
