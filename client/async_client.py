"""The asyncio lorad client: typed results, typed errors, deadlines, retries, resumable watch and download."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from lorad.client import _convert as conv
from lorad.client import _requests as rq
from lorad.client import config as cfg
from lorad.client import types as t
from lorad.client._download import DownloadLock, PartFile, ProgressCallback, resumable_download, safe_filename
from lorad.client.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    IntegrityError,
    LoradError,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from lorad.client.retry import IDEMPOTENT_METHODS, RetryPolicy
from lorad.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    apps_pb2,
    apps_pb2_grpc,
    data_pb2,
    data_pb2_grpc,
    device_pb2,
    device_pb2_grpc,
    inference_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
)

log = logging.getLogger(__name__)

MAX_RECEIVE_BYTES = 32 * 1024 * 1024  # a download chunk is <= 1 MiB; listings of 1,000 samples can be large
IMPORT_CHUNK = 1024 * 1024  # ImportAdapter chunks are at most 1 MiB
MAX_SEND_BYTES = 17 * 1024 * 1024  # AppendSamples allows 16 MiB per request

JobRef = t.Job | str
AdapterRef = t.Adapter | t.Job | str


def _job_id(job: JobRef) -> str:
    return job.job_id if isinstance(job, t.Job) else job


class AsyncClient:
    """Asyncio client of one lorad daemon. Create it inside a running event loop; close it (or `async with`).

    Args:
        target: Socket path, "unix:..." or "host:port"; default LORAD_TARGET, client.toml, then the daemon's socket.
        token: App token (owner token for app management); default LORAD_TOKEN, then client.toml.
        timeout: Deadline of each unary call attempt, seconds (default 30, or `timeout_seconds` in client.toml).
        retry: Backoff policy for UNAVAILABLE on idempotent calls, streams' reconnects and download resumes.
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
        self.settings = cfg.resolve(target, token, timeout_seconds=timeout, data_dir=data_dir)
        self.retry = retry or RetryPolicy()
        self._channel = grpc.aio.insecure_channel(
            self.settings.target,
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ],
        )
        self._apps = apps_pb2_grpc.AppServiceStub(self._channel)
        self._data = data_pb2_grpc.DataServiceStub(self._channel)
        self._jobs = jobs_pb2_grpc.JobServiceStub(self._channel)
        self._adapters = adapters_pb2_grpc.AdapterServiceStub(self._channel)
        self._inference = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._device = device_pb2_grpc.DeviceServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {self.settings.token}"),) if self.settings.token else ()

    @classmethod
    def for_owner(cls, data_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> AsyncClient:
        """A client holding the device owner's token ($LORAD_OWNER_TOKEN or <data_dir>/owner.token)."""
        token, source = cfg.owner_token(data_dir)
        client = cls(token=token, data_dir=data_dir, **kwargs)
        client.settings = dataclasses.replace(client.settings, token_source=source)
        return client

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- plumbing --------------------------------------------------------------------------------------------------

    def _error(self, err: grpc.RpcError) -> LoradError:
        mapped = from_rpc_error(err, target=self.settings.target)
        if isinstance(mapped, Unauthenticated):
            if self.settings.token:
                mapped.message += f" (token from {self.settings.token_source}; it may be revoked or mistyped)"
            else:
                mapped.message += (
                    f"; no token was configured: pass token=/--token, set {cfg.ENV_TOKEN}, or add "
                    f'token = "..." to {cfg.config_file_path()}'
                )
        return mapped

    async def _unary(self, method: str, rpc: Callable[..., Any], request: Any) -> Any:
        retries = self.retry.max_attempts - 1 if method in IDEMPOTENT_METHODS else 0
        for attempt in range(retries + 1):
            try:
                return await rpc(request, metadata=self._metadata, timeout=self.settings.timeout_seconds)
            except grpc.RpcError as exc:
                err = self._error(exc)
                if not isinstance(err, Unavailable) or attempt >= retries:
                    raise err from None
                delay = self.retry.delay(attempt)
                log.debug("rpc_retry method=%s attempt=%d delay_s=%.3f", method, attempt + 1, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _pages(self, method: str, rpc: Callable[..., Any], make: Callable[[str], Any], field: str) -> list[Any]:
        items: list[Any] = []
        token = ""
        while True:
            resp = await self._unary(method, rpc, make(token))
            items.extend(getattr(resp, field))
            token = resp.next_page_token
            if not token:
                return items

    async def wait_ready(self, timeout: float = 10.0) -> t.DeviceStatus:
        """Waits until the daemon answers GetDeviceStatus, polling with backoff. A daemon that is not listening yet
        (Unavailable) or too busy starting up to answer one attempt in time (DeadlineExceeded) is asked again until
        `timeout` has passed.

        Raises:
            Unavailable: It did not answer within `timeout` seconds.
            DeadlineExceeded: Its last attempt, at the end of `timeout`, timed out.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        attempt = 0
        while True:
            try:
                return conv.device_status(
                    await self._device.GetDeviceStatus(
                        device_pb2.GetDeviceStatusRequest(), metadata=self._metadata, timeout=max(0.2, timeout / 4)
                    )
                )
            except grpc.RpcError as exc:
                err = self._error(exc)
                if not isinstance(err, Unavailable | DeadlineExceeded) or loop.time() >= deadline:
                    raise err from None
            await asyncio.sleep(min(self.retry.delay(attempt), max(0.0, deadline - loop.time())))
            attempt += 1

    # --- apps (owner token) ----------------------------------------------------------------------------------------

    async def register_app(
        self, app_id: str, display_name: str = "", quota: t.AppQuota | None = None
    ) -> t.RegisteredApp:
        """Registers an app (owner only) and returns it with its token, shown this once."""
        req = apps_pb2.RegisterAppRequest(app_id=app_id, display_name=display_name)
        if quota is not None:
            req.quota.CopyFrom(conv.quota_to_pb(quota))
        resp = await self._unary("RegisterApp", self._apps.RegisterApp, req)
        return t.RegisteredApp(conv.app(resp.app), resp.token)

    async def list_apps(self) -> list[t.App]:
        """Lists registered apps (owner only), ordered by id."""
        pb = await self._pages(
            "ListApps", self._apps.ListApps, lambda tok: apps_pb2.ListAppsRequest(page_token=tok), "apps"
        )
        return [conv.app(a) for a in pb]

    async def revoke_app(self, app_id: str) -> None:
        """Revokes an app's token at once (owner only); its data stays until forget_app."""
        await self._unary("RevokeApp", self._apps.RevokeApp, apps_pb2.RevokeAppRequest(app_id=app_id))

    async def rotate_app_token(self, app_id: str) -> str:
        """Issues a new token for an app (owner only) and returns it; the old token stops working at once."""
        req = apps_pb2.RotateAppTokenRequest(app_id=app_id)
        return str((await self._unary("RotateAppToken", self._apps.RotateAppToken, req)).token)

    # --- data ------------------------------------------------------------------------------------------------------

    async def append_samples(
        self, dataset_id: str, samples: Iterable[t.Sample | str | dict[str, Any]]
    ) -> t.AppendResult:
        """Appends samples (str = text; dicts as in JSONL), in atomic batches of up to 1,000; safe to retry.

        Returns:
            Totals over all batches, the ids in input order, and the dataset after the last batch.
        """
        accepted = duplicates = 0
        ids: list[str] = []
        dataset: t.Dataset | None = None
        for batch in rq.batches(samples):
            req = data_pb2.AppendSamplesRequest(dataset_id=dataset_id, samples=batch)
            r = conv.append_result(await self._unary("AppendSamples", self._data.AppendSamples, req))
            accepted, duplicates, dataset = accepted + r.accepted_count, duplicates + r.duplicate_count, r.dataset
            ids.extend(r.sample_ids)
        return t.AppendResult(accepted, duplicates, tuple(ids), dataset)

    async def list_datasets(self) -> list[t.Dataset]:
        """Lists the app's datasets, ordered by id."""
        pb = await self._pages(
            "ListDatasets",
            self._data.ListDatasets,
            lambda tok: data_pb2.ListDatasetsRequest(page_token=tok),
            "datasets",
        )
        return [conv.dataset(d) for d in pb]

    async def get_dataset(self, dataset_id: str) -> t.Dataset:
        """Gets one dataset."""
        resp = await self._unary("GetDataset", self._data.GetDataset, data_pb2.GetDatasetRequest(dataset_id=dataset_id))
        return conv.dataset(resp.dataset)

    async def list_samples(self, dataset_id: str) -> list[t.StoredSample]:
        """Lists a dataset's samples, oldest first."""
        pb = await self._pages(
            "ListSamples",
            self._data.ListSamples,
            lambda tok: data_pb2.ListSamplesRequest(dataset_id=dataset_id, page_token=tok),
            "samples",
        )
        return [conv.stored_sample(s) for s in pb]

    async def delete_dataset(
        self, dataset_id: str, cancel_dependents: bool = False, delete_adapters: bool = False
    ) -> t.DatasetDeleted:
        """Deletes a dataset, its samples and the checkpoints of the jobs that read it.

        Unfinished jobs or schedules reading it make this FailedPrecondition unless ``cancel_dependents``. The adapters
        that learned from it stay unless ``delete_adapters`` (then those trained on it, and those trained on from
        them, go too).
        """
        req = data_pb2.DeleteDatasetRequest(
            dataset_id=dataset_id, cancel_dependents=cancel_dependents, delete_adapters=delete_adapters
        )
        return conv.dataset_deleted(await self._unary("DeleteDataset", self._data.DeleteDataset, req))

    async def forget_app(self, app_id: str = "") -> t.ForgetResult:
        """Deletes all of an app's data, jobs and adapters (an app names itself or ""; the owner names one)."""
        req = data_pb2.ForgetAppRequest(app_id=app_id)
        return conv.forget_result(await self._unary("ForgetApp", self._data.ForgetApp, req))

    # --- jobs ------------------------------------------------------------------------------------------------------

    async def create_job(
        self,
        dataset_ids: Sequence[str],
        config: t.TrainingConfig | None = None,
        *,
        requirements: t.DeviceRequirements | None = None,
        window: t.TrainingWindow | None = None,
        request_id: str | None = None,
    ) -> t.Job:
        """Creates a training job; retried safely on UNAVAILABLE under one request_id (generated if not given)."""
        req = jobs_pb2.CreateJobRequest(
            request_id=request_id or f"sdk-{uuid.uuid4().hex}",
            dataset_ids=list(dataset_ids),
            config=conv.training_config_to_pb(config or t.TrainingConfig()),
            requirements=conv.requirements_to_pb(requirements or t.DeviceRequirements()),
        )
        if window is not None:
            req.window.CopyFrom(conv.window_to_pb(window))
        return conv.job((await self._unary("CreateJob", self._jobs.CreateJob, req)).job)

    async def get_job(self, job: JobRef) -> t.Job:
        """Gets one job."""
        resp = await self._unary("GetJob", self._jobs.GetJob, jobs_pb2.GetJobRequest(job_id=_job_id(job)))
        return conv.job(resp.job)

    async def list_jobs(self, states: Iterable[t.JobState] = ()) -> list[t.Job]:
        """Lists the app's jobs, newest first, optionally only in `states`."""
        wanted: list[Any] = [conv.JOB_STATE.pb(s) for s in states]
        pb = await self._pages(
            "ListJobs", self._jobs.ListJobs, lambda tok: jobs_pb2.ListJobsRequest(page_token=tok, states=wanted), "jobs"
        )
        return [conv.job(j) for j in pb]

    async def pause_job(self, job: JobRef) -> t.Job:
        """Asks a job to pause; returns it PAUSING or PAUSED."""
        resp = await self._unary("PauseJob", self._jobs.PauseJob, jobs_pb2.PauseJobRequest(job_id=_job_id(job)))
        return conv.job(resp.job)

    async def resume_job(self, job: JobRef) -> t.Job:
        """Resumes a PAUSED job."""
        resp = await self._unary("ResumeJob", self._jobs.ResumeJob, jobs_pb2.ResumeJobRequest(job_id=_job_id(job)))
        return conv.job(resp.job)

    async def cancel_job(self, job: JobRef) -> t.Job:
        """Cancels a job that is not final."""
        resp = await self._unary("CancelJob", self._jobs.CancelJob, jobs_pb2.CancelJobRequest(job_id=_job_id(job)))
        return conv.job(resp.job)

    async def list_job_events(self, job: JobRef, after_event_id: int = 0) -> list[t.JobEvent]:
        """Lists a job's events after `after_event_id`, oldest first (all pages)."""
        events: list[t.JobEvent] = []
        while True:
            req = jobs_pb2.ListJobEventsRequest(job_id=_job_id(job), after_event_id=after_event_id)
            resp = await self._unary("ListJobEvents", self._jobs.ListJobEvents, req)
            events.extend(conv.job_event(e) for e in resp.events)
            if not resp.has_more or not resp.events:
                return events
            after_event_id = resp.events[-1].event_id

    async def list_checkpoints(self, job: JobRef) -> list[t.Checkpoint]:
        """Lists a job's checkpoints, ordered by step."""
        req = jobs_pb2.ListCheckpointsRequest(job_id=_job_id(job))
        resp = await self._unary("ListCheckpoints", self._jobs.ListCheckpoints, req)
        return [conv.checkpoint(c) for c in resp.checkpoints]

    async def watch(self, job: JobRef, after_event_id: int = 0) -> AsyncIterator[t.JobUpdate]:
        """Yields the job's events (after `after_event_id`) until it is final, reconnecting where it left off.

        A broken stream (daemon restart, UNAVAILABLE) is reopened with the last event id seen, with backoff, so
        no event is repeated or lost; the attempt count resets whenever an event arrives.
        """
        job_id, last, failures = _job_id(job), after_event_id, 0
        while True:
            req = jobs_pb2.WatchJobRequest(job_id=job_id, after_event_id=last)
            final = False
            call = self._jobs.WatchJob(req, metadata=self._metadata)
            try:
                async for resp in call:
                    update = t.JobUpdate(conv.job_event(resp.event), conv.job(resp.job))
                    last, failures, final = update.event.event_id, 0, update.job.is_final
                    yield update
            except grpc.RpcError as exc:
                err = self._error(exc)
                if not isinstance(err, Unavailable) or failures + 1 >= self.retry.max_attempts:
                    raise err from None
            else:
                # The daemon ends the stream after the final state; an earlier end (graceful restart) reconnects.
                if final:
                    return
                if (await self.get_job(job_id)).is_final and not await self._has_events_after(job_id, last):
                    return
            finally:
                call.cancel()  # a caller that stops iterating early must not leave the stream open
            await asyncio.sleep(self.retry.delay(failures))
            failures += 1

    async def _has_events_after(self, job_id: str, last: int) -> bool:
        req = jobs_pb2.ListJobEventsRequest(job_id=job_id, after_event_id=last, page_size=1)
        return bool((await self._unary("ListJobEvents", self._jobs.ListJobEvents, req)).events)

    async def create_schedule(
        self,
        dataset_ids: Sequence[str],
        window: t.TrainingWindow,
        config: t.TrainingConfig | None = None,
        *,
        requirements: t.DeviceRequirements | None = None,
    ) -> t.Schedule:
        """Creates a recurring schedule (e.g. cron "30 2 * * *") that queues a job at each firing."""
        req = jobs_pb2.CreateScheduleRequest(
            dataset_ids=list(dataset_ids),
            config=conv.training_config_to_pb(config or t.TrainingConfig()),
            requirements=conv.requirements_to_pb(requirements or t.DeviceRequirements()),
            window=conv.window_to_pb(window),
        )
        return conv.schedule((await self._unary("CreateSchedule", self._jobs.CreateSchedule, req)).schedule)

    async def list_schedules(self) -> list[t.Schedule]:
        """Lists the app's schedules."""
        resp = await self._unary("ListSchedules", self._jobs.ListSchedules, jobs_pb2.ListSchedulesRequest())
        return [conv.schedule(s) for s in resp.schedules]

    async def delete_schedule(self, schedule_id: str) -> None:
        """Deletes a schedule; jobs it created stay."""
        req = jobs_pb2.DeleteScheduleRequest(schedule_id=schedule_id)
        await self._unary("DeleteSchedule", self._jobs.DeleteSchedule, req)

    # --- adapters --------------------------------------------------------------------------------------------------

    async def list_adapters(self) -> list[t.Adapter]:
        """Lists the app's adapters, newest first."""
        pb = await self._pages(
            "ListAdapters",
            self._adapters.ListAdapters,
            lambda tok: adapters_pb2.ListAdaptersRequest(page_token=tok),
            "adapters",
        )
        return [conv.adapter(a) for a in pb]

    async def get_adapter(self, adapter: AdapterRef) -> t.Adapter:
        """Gets one adapter: by Adapter, adapter id, Job or job id (as download_adapter and delete_adapter)."""
        req = adapters_pb2.GetAdapterRequest(adapter_id=await self.adapter_id_of(adapter))
        return conv.adapter((await self._unary("GetAdapter", self._adapters.GetAdapter, req)).adapter)

    async def delete_adapter(self, adapter: AdapterRef, cancel_dependents: bool = False) -> int:
        """Deletes an adapter and its exports; returns the bytes freed.

        Unfinished jobs or schedules that start from it (``init_adapter_id``) make this FailedPrecondition naming them
        unless ``cancel_dependents`` (then the jobs are cancelled and the schedules deleted with it).
        """
        req = adapters_pb2.DeleteAdapterRequest(
            adapter_id=await self.adapter_id_of(adapter), cancel_dependents=cancel_dependents
        )
        return int((await self._unary("DeleteAdapter", self._adapters.DeleteAdapter, req)).freed_bytes)

    async def import_adapter(self, peft_tar: bytes, base_model_sha256: str, base_model: str = "") -> t.Adapter:
        """Stores a PEFT adapter tar (as download_adapter writes it) in the app's registry.

        Args:
            peft_tar: the uncompressed tar of adapter_config.json + adapter_model.safetensors.
            base_model_sha256: the base model the adapter was made for; the daemon refuses another.
            base_model: the daemon's model name; empty means its default model.

        Raises:
            FailedPrecondition: the daemon's base model differs.
            InvalidArgument: not a loadable PEFT LoRA adapter, or a size/digest mismatch.
        """
        header = adapters_pb2.ImportAdapterHeader(
            base_model=base_model,
            base_model_sha256=base_model_sha256,
            total_size_bytes=len(peft_tar),
            sha256=hashlib.sha256(peft_tar).hexdigest(),
        )

        async def messages() -> AsyncIterator[adapters_pb2.ImportAdapterRequest]:
            yield adapters_pb2.ImportAdapterRequest(header=header)
            for off in range(0, len(peft_tar), IMPORT_CHUNK):
                yield adapters_pb2.ImportAdapterRequest(chunk=peft_tar[off : off + IMPORT_CHUNK])

        try:
            resp = await self._adapters.ImportAdapter(
                messages(), metadata=self._metadata, timeout=self.settings.timeout_seconds
            )
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        return conv.adapter(resp.adapter)

    async def adapter_id_of(self, ref: AdapterRef) -> str:
        """The adapter id of an Adapter, a (succeeded) Job, a job id ("job_...") or an adapter id.

        A Job object without an adapter is fetched again: it may be a snapshot taken before the job succeeded
        (e.g. the one `create_job` returned, after `watch` ended).

        Raises:
            FailedPrecondition: The job has produced no adapter (yet); the message names its state.
        """
        if isinstance(ref, t.Adapter):
            return ref.adapter_id
        if isinstance(ref, str) and not ref.startswith("job_"):
            return ref
        job = ref if isinstance(ref, t.Job) and ref.adapter_id else await self.get_job(_job_id(ref))
        if not job.adapter_id:
            raise FailedPrecondition(
                f"job {job.job_id} has no adapter: it is {job.state.value}; wait until it succeeds"
            )
        return job.adapter_id

    async def download_adapter(
        self,
        adapter: AdapterRef,
        path: str | os.PathLike[str],
        format: t.AdapterFormat | str = t.AdapterFormat.PEFT,
        *,
        overwrite: bool = False,
        on_progress: ProgressCallback | None = None,
    ) -> t.DownloadResult:
        """Downloads an adapter file, verifying size and sha256, resuming from `<path>.part` after a break.

        Bytes are written to `<path>.part`; only a complete, verified file is fsynced and renamed to `path`.
        A broken stream is resumed at once (with backoff); an interrupted process resumes on the next call.

        Args:
            adapter: Adapter, Job, job id or adapter id.
            path: Destination file, or a directory (an existing one, or a path ending in "/", created if needed)
                where the daemon's suggested file name is used.
            format: "peft" (tar of the PEFT folder), "gguf" (llama.cpp LoRA) or "merged" (tar of a full model).
            overwrite: Replace an existing destination file.
            on_progress: Called with (bytes received, total bytes) after each chunk.

        Raises:
            AlreadyExists: `path` exists and overwrite is False.
            IntegrityError: The digest did not match after a fresh download.
        """
        adapter_id = await self.adapter_id_of(adapter)
        fmt = t.AdapterFormat(format)
        as_dir = str(path).endswith(("/", os.sep))
        dest = Path(path).expanduser()
        if as_dir:
            dest.mkdir(parents=True, exist_ok=True)
        if dest.is_dir():
            header = await self._download_header(adapter_id, fmt)
            dest = dest / safe_filename(header.filename, f"{adapter_id}.{fmt.value}")
        exists = f"{dest} already exists; choose another path or pass overwrite=True (CLI: --force)"
        if dest.exists() and not overwrite:
            raise AlreadyExists(exists)
        req = adapters_pb2.DownloadAdapterRequest(adapter_id=adapter_id, format=conv.ADAPTER_FORMAT.pb(fmt))

        def open_stream(offset: int) -> AsyncIterator[Any]:
            req.read_offset = offset
            stream: AsyncIterator[Any] = self._adapters.DownloadAdapter(req, metadata=self._metadata)
            return stream

        # One writer per destination (threads and processes alike): a second pull waits, then finds the file.
        async with DownloadLock(dest):
            if dest.exists() and not overwrite:
                raise AlreadyExists(exists)
            part = PartFile(dest)
            return await resumable_download(open_stream, part, fmt, self.retry, self._error, on_progress=on_progress)

    async def _download_header(self, adapter_id: str, fmt: t.AdapterFormat) -> adapters_pb2.DownloadHeader:
        req = adapters_pb2.DownloadAdapterRequest(adapter_id=adapter_id, format=conv.ADAPTER_FORMAT.pb(fmt))
        call = self._adapters.DownloadAdapter(req, metadata=self._metadata, timeout=self.settings.timeout_seconds)
        try:
            async for msg in call:
                if msg.WhichOneof("payload") == "header":
                    header: adapters_pb2.DownloadHeader = msg.header
                    return header
                break
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        finally:
            call.cancel()
        raise IntegrityError("download stream did not start with a header")

    # --- inference and device --------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[t.ChatMessage],
        *,
        adapter: AdapterRef | None = None,
        raw: bool = False,
        system: str | None = None,
        max_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 0.0,
        seed: int = 0,
        stop: Sequence[str] = (),
        base_model: str = "",
        extra_adapters: Sequence[AdapterRef] = (),
        repetition_penalty: float = 0.0,
    ) -> AsyncIterator[t.GenerateChunk]:
        """Streams generated text. A string prompt is one user turn (raw=True continues it as plain text).

        ``extra_adapters`` are applied together with ``adapter`` (e.g. a federated global and a personal adapter):
        their updates add. ``temperature`` 0 decodes greedily; ``top_p`` (0 = off) limits sampling to the likeliest
        tokens; ``repetition_penalty`` 1 to 2 discourages repeating recent output (0 = the daemon's 1.1, 1 = off).
        """
        req = rq.generate_request(
            prompt,
            adapter_id=await self.adapter_id_of(adapter) if adapter is not None else "",
            raw=raw,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            base_model=base_model,
            system=system,
            extra_adapter_ids=[await self.adapter_id_of(a) for a in extra_adapters],
            repetition_penalty=repetition_penalty,
        )
        call = self._inference.Generate(req, metadata=self._metadata)
        try:
            async for msg in call:
                yield conv.generate_chunk(msg)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        finally:
            call.cancel()

    async def generate_text(self, prompt: str | Sequence[t.ChatMessage], **kwargs: Any) -> str:
        """Like generate(), but returns the whole text."""
        return "".join([c.text async for c in self.generate(prompt, **kwargs)])

    async def disk_usage(self) -> t.DiskUsage:
        """Bytes on disk: this app's data, checkpoints, adapters and exports (the owner token: every app's, plus
        the shared caches and the database)."""
        resp = await self._unary("GetDiskUsage", self._device.GetDiskUsage, device_pb2.GetDiskUsageRequest())
        return conv.disk_usage(resp)

    async def collect_garbage(self) -> t.GarbageCollected:
        """Deletes rebuildable files: this app's cached exports (the owner token: every app's, and the shared
        model caches when no job trains)."""
        resp = await self._unary("CollectGarbage", self._device.CollectGarbage, device_pb2.CollectGarbageRequest())
        return conv.garbage_collected(resp)

    async def device_status(self) -> t.DeviceStatus:
        """Backend, device readings, whether training may run and what the app's current job waits for."""
        resp = await self._unary("GetDeviceStatus", self._device.GetDeviceStatus, device_pb2.GetDeviceStatusRequest())
        return conv.device_status(resp)
