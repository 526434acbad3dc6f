"""The one place where lorad.v1 protobuf messages and the SDK's dataclasses are converted into each other."""

from __future__ import annotations

import enum
from typing import Any, TypeVar

from lorad.client import types as t
from lorad.v1 import (
    adapters_pb2,
    apps_pb2,
    common_pb2,
    data_pb2,
    device_pb2,
    inference_pb2,
    jobs_pb2,
)

E = TypeVar("E", bound=enum.Enum)


class _EnumMap:
    """Maps one proto enum (values named PREFIX_NAME) onto one Python enum, both ways."""

    def __init__(self, wrapper: Any, prefix: str, py: type[enum.Enum], unspecified: enum.Enum | None) -> None:
        self._to_py: dict[int, enum.Enum | None] = {}
        self._to_pb: dict[enum.Enum, int] = {}
        self._unspecified = unspecified
        for name, number in wrapper.items():
            suffix = name.removeprefix(prefix)
            member = unspecified if suffix == "UNSPECIFIED" else py[suffix]
            self._to_py[number] = member
            if member is not None:
                self._to_pb[member] = number

    def py(self, number: int) -> Any:
        # A value added by a newer daemon reads as "unspecified" rather than failing the whole call.
        return self._to_py.get(number, self._unspecified)

    def pb(self, member: enum.Enum | None) -> Any:
        # Any: the generated stubs type enum fields as their NewType ValueType, which a plain int satisfies at runtime.
        return 0 if member is None else self._to_pb[member]


ROLE = _EnumMap(common_pb2.Role, "ROLE_", t.Role, None)
BACKEND = _EnumMap(common_pb2.Backend, "BACKEND_", t.Backend, t.Backend.AUTO)
PRECISION = _EnumMap(common_pb2.Precision, "PRECISION_", t.Precision, t.Precision.AUTO)
LR_SCHEDULE = _EnumMap(common_pb2.LrSchedule, "LR_SCHEDULE_", t.LrSchedule, t.LrSchedule.DEFAULT)
JOB_STATE = _EnumMap(jobs_pb2.JobState, "JOB_STATE_", t.JobState, t.JobState.UNSPECIFIED)
BLOCKED = _EnumMap(jobs_pb2.BlockedReason, "BLOCKED_REASON_", t.BlockedReason, t.BlockedReason.NONE)
EVENT_KIND = _EnumMap(jobs_pb2.JobEventKind, "JOB_EVENT_KIND_", t.JobEventKind, t.JobEventKind.UNSPECIFIED)
ADAPTER_FORMAT = _EnumMap(adapters_pb2.AdapterFormat, "ADAPTER_FORMAT_", t.AdapterFormat, t.AdapterFormat.PEFT)
PROFILE = _EnumMap(device_pb2.DeviceProfile, "DEVICE_PROFILE_", t.DeviceProfile, t.DeviceProfile.UNSPECIFIED)
PHASE = _EnumMap(jobs_pb2.JobPhase, "JOB_PHASE_", t.JobPhase, t.JobPhase.UNSPECIFIED)
FINISH = _EnumMap(inference_pb2.FinishReason, "FINISH_REASON_", t.FinishReason, None)


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


# --- to protobuf ---------------------------------------------------------------------------------------------------


def sample_to_pb(sample: t.Sample) -> common_pb2.Sample:
    """Converts a TextSample or ChatSample."""
    if isinstance(sample, t.TextSample):
        return common_pb2.Sample(text=sample.text)
    return common_pb2.Sample(chat=chat_to_pb(sample.messages))


def chat_to_pb(messages: tuple[t.ChatMessage, ...] | list[t.ChatMessage]) -> common_pb2.Chat:
    """Converts chat turns."""
    return common_pb2.Chat(
        messages=[common_pb2.ChatMessage(role=ROLE.pb(t.Role(m.role)), content=m.content) for m in messages]
    )


def lora_to_pb(lora: t.LoraConfig) -> common_pb2.LoraConfig:
    """Converts LoRA hyperparameters."""
    return common_pb2.LoraConfig(
        rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=list(lora.target_modules)
    )


def training_config_to_pb(c: t.TrainingConfig) -> common_pb2.TrainingConfig:
    """Converts a training configuration."""
    return common_pb2.TrainingConfig(
        base_model=c.base_model,
        lora=lora_to_pb(c.lora),
        max_steps=c.max_steps,
        learning_rate=c.learning_rate,
        batch_size=c.batch_size,
        seq_len=c.seq_len,
        grad_accum_steps=c.grad_accum_steps,
        warmup_steps=c.warmup_steps,
        lr_schedule=LR_SCHEDULE.pb(c.lr_schedule),
        weight_decay=c.weight_decay,
        max_grad_norm=c.max_grad_norm,
        eval_every_steps=c.eval_every_steps,
        checkpoint_every_steps=c.checkpoint_every_steps,
        seed=c.seed,
        backend=BACKEND.pb(c.backend),
        precision=PRECISION.pb(c.precision),
        eval_fraction=c.eval_fraction,
        init_adapter_id=c.init_adapter_id,
        freeze_lora_a=c.freeze_lora_a,
    )


def requirements_to_pb(r: t.DeviceRequirements) -> common_pb2.DeviceRequirements:
    """Converts device requirements; None fields stay unset so the daemon's defaults apply."""
    msg = common_pb2.DeviceRequirements()
    if r.require_charging is not None:
        msg.require_charging = r.require_charging
    if r.min_battery_percent is not None:
        msg.min_battery_percent = r.min_battery_percent
    if r.max_temperature_celsius is not None:
        msg.max_temperature_celsius = r.max_temperature_celsius
    if r.require_idle is not None:
        msg.require_idle = r.require_idle
    return msg


def window_to_pb(w: t.TrainingWindow) -> common_pb2.TrainingWindow:
    """Converts a training window."""
    return common_pb2.TrainingWindow(cron=w.cron, jitter_seconds=w.jitter_seconds, timezone=w.timezone)


def quota_to_pb(q: t.AppQuota) -> apps_pb2.AppQuota:
    """Converts app limits."""
    return apps_pb2.AppQuota(
        max_samples=q.max_samples,
        max_sample_bytes=q.max_sample_bytes,
        max_adapters=q.max_adapters,
        max_active_jobs=q.max_active_jobs,
    )


# --- from protobuf -------------------------------------------------------------------------------------------------


def sample(m: common_pb2.Sample) -> t.Sample:
    """Converts a sample."""
    if m.WhichOneof("content") == "chat":
        return t.ChatSample(tuple(t.ChatMessage(ROLE.py(x.role), x.content) for x in m.chat.messages))
    return t.TextSample(m.text)


def stored_sample(m: common_pb2.StoredSample) -> t.StoredSample:
    """Converts a stored sample."""
    return t.StoredSample(m.sample_id, m.created_at_ms, m.size_bytes, sample(m.sample))


def quota(m: apps_pb2.AppQuota) -> t.AppQuota:
    """Converts app limits."""
    return t.AppQuota(m.max_samples, m.max_sample_bytes, m.max_adapters, m.max_active_jobs)


def app(m: apps_pb2.App) -> t.App:
    """Converts an app."""
    return t.App(m.app_id, m.display_name, m.created_at_ms, quota(m.quota), m.sample_count, m.sample_bytes, m.revoked)


def dataset(m: data_pb2.Dataset) -> t.Dataset:
    """Converts a dataset."""
    return t.Dataset(m.dataset_id, m.sample_count, m.size_bytes, m.created_at_ms, m.updated_at_ms)


def append_result(m: data_pb2.AppendSamplesResponse) -> t.AppendResult:
    """Converts the outcome of an append."""
    ds = dataset(m.dataset) if m.HasField("dataset") else None
    return t.AppendResult(m.accepted_count, m.duplicate_count, tuple(m.sample_ids), ds)


def dataset_deleted(m: data_pb2.DeleteDatasetResponse) -> t.DatasetDeleted:
    """Converts the outcome of DeleteDataset."""
    return t.DatasetDeleted(m.deleted_samples, m.deleted_adapters)


def forget_result(m: data_pb2.ForgetAppResponse) -> t.ForgetResult:
    """Converts the outcome of ForgetApp."""
    return t.ForgetResult(m.deleted_samples, m.deleted_adapters, m.deleted_jobs, m.freed_bytes)


def lora(m: common_pb2.LoraConfig) -> t.LoraConfig:
    """Converts LoRA hyperparameters."""
    return t.LoraConfig(m.rank, m.alpha, m.dropout, tuple(m.target_modules))


def training_config(m: common_pb2.TrainingConfig) -> t.TrainingConfig:
    """Converts a training configuration."""
    return t.TrainingConfig(
        base_model=m.base_model,
        lora=lora(m.lora),
        max_steps=m.max_steps,
        learning_rate=m.learning_rate,
        batch_size=m.batch_size,
        seq_len=m.seq_len,
        grad_accum_steps=m.grad_accum_steps,
        warmup_steps=m.warmup_steps,
        lr_schedule=LR_SCHEDULE.py(m.lr_schedule),
        weight_decay=m.weight_decay,
        max_grad_norm=m.max_grad_norm,
        eval_every_steps=m.eval_every_steps,
        checkpoint_every_steps=m.checkpoint_every_steps,
        seed=m.seed,
        backend=BACKEND.py(m.backend),
        precision=PRECISION.py(m.precision),
        eval_fraction=m.eval_fraction,
        init_adapter_id=m.init_adapter_id,
        freeze_lora_a=m.freeze_lora_a,
    )


def requirements(m: common_pb2.DeviceRequirements) -> t.DeviceRequirements:
    """Converts device requirements."""
    return t.DeviceRequirements(
        _opt(m, "require_charging"),
        _opt(m, "min_battery_percent"),
        _opt(m, "max_temperature_celsius"),
        _opt(m, "require_idle"),
    )


def window(m: common_pb2.TrainingWindow) -> t.TrainingWindow:
    """Converts a training window."""
    return t.TrainingWindow(m.cron, m.jitter_seconds, m.timezone)


def progress(m: jobs_pb2.JobProgress) -> t.JobProgress:
    """Converts job progress."""
    return t.JobProgress(
        step=m.step,
        total_steps=m.total_steps,
        train_loss=m.train_loss,
        eval_loss=_opt(m, "eval_loss"),
        eval_loss_before=_opt(m, "eval_loss_before"),
        tokens_per_second=m.tokens_per_second,
        eta_seconds=_opt(m, "eta_seconds"),
        learning_rate=m.learning_rate,
        tokens_seen=m.tokens_seen,
        data=job_data(m.data) if m.HasField("data") else None,
    )


def job_data(m: jobs_pb2.JobData) -> t.JobData:
    """Converts a job's data summary."""
    r = m.rejected
    rejected = t.RejectedSamples(
        r.empty, r.too_long, r.no_assistant_turn, r.no_target_tokens, r.bad_role, r.render_error, r.other
    )
    return t.JobData(m.total_samples, m.train_samples, m.eval_samples, m.train_tokens, rejected)


def _error(parent: Any) -> t.JobError | None:
    return t.JobError(parent.error.code, parent.error.message) if parent.HasField("error") else None


def checkpoint(m: jobs_pb2.Checkpoint) -> t.Checkpoint:
    """Converts a checkpoint."""
    return t.Checkpoint(m.checkpoint_id, m.job_id, m.step, m.created_at_ms, m.size_bytes, m.train_loss)


def job(m: jobs_pb2.Job) -> t.Job:
    """Converts a job."""
    return t.Job(
        job_id=m.job_id,
        request_id=m.request_id,
        dataset_ids=tuple(m.dataset_ids),
        config=training_config(m.config),
        requirements=requirements(m.requirements),
        window=window(m.window) if m.HasField("window") else None,
        state=JOB_STATE.py(m.state),
        blocked_reason=BLOCKED.py(m.blocked_reason),
        blocked_detail=m.blocked_detail,
        progress=progress(m.progress),
        error=_error(m),
        adapter_id=m.adapter_id,
        backend=m.backend,
        schedule_id=m.schedule_id,
        created_at_ms=m.created_at_ms,
        started_at_ms=m.started_at_ms,
        finished_at_ms=m.finished_at_ms,
        data_until_ms=m.data_until_ms,
        phase=PHASE.py(m.phase),
        phase_fraction=_opt(m, "phase_fraction"),
    )


def job_event(m: jobs_pb2.JobEvent) -> t.JobEvent:
    """Converts a job event."""
    return t.JobEvent(
        event_id=m.event_id,
        job_id=m.job_id,
        time_ms=m.time_ms,
        kind=EVENT_KIND.py(m.kind),
        state=JOB_STATE.py(m.state),
        blocked_reason=BLOCKED.py(m.blocked_reason),
        progress=progress(m.progress),
        checkpoint=checkpoint(m.checkpoint) if m.HasField("checkpoint") else None,
        message=m.message,
        error=_error(m),
        phase=PHASE.py(m.phase),
        phase_fraction=_opt(m, "phase_fraction"),
    )


def schedule(m: jobs_pb2.Schedule) -> t.Schedule:
    """Converts a schedule."""
    return t.Schedule(
        m.schedule_id,
        tuple(m.dataset_ids),
        training_config(m.config),
        requirements(m.requirements),
        window(m.window) if m.HasField("window") else None,
        m.next_run_at_ms,
        m.created_at_ms,
    )


def adapter(m: adapters_pb2.Adapter) -> t.Adapter:
    """Converts an adapter."""
    return t.Adapter(
        adapter_id=m.adapter_id,
        job_id=m.job_id,
        base_model=m.base_model,
        base_model_sha256=m.base_model_sha256,
        tokenizer_sha256=m.tokenizer_sha256,
        lora=lora(m.lora),
        steps=m.steps,
        eval_loss_before=m.eval_loss_before,
        eval_loss_after=m.eval_loss_after,
        train_loss=m.train_loss,
        precision_plan=tuple(
            t.LayerPrecision(p.layer, PRECISION.py(p.forward), PRECISION.py(p.backward)) for p in m.precision_plan
        ),
        data_until_ms=m.data_until_ms,
        sample_count=m.sample_count,
        created_at_ms=m.created_at_ms,
        size_bytes=m.size_bytes,
    )


def generate_chunk(m: inference_pb2.GenerateResponse) -> t.GenerateChunk:
    """Converts one streamed generation message."""
    return t.GenerateChunk(m.text, m.token_count, FINISH.py(m.finish_reason), m.prompt_token_count)


def disk_usage(m: device_pb2.GetDiskUsageResponse) -> t.DiskUsage:
    """Converts disk usage."""
    apps = tuple(
        t.AppDiskUsage(a.app_id, a.data_bytes, a.checkpoint_bytes, a.adapter_bytes, a.export_bytes) for a in m.apps
    )
    return t.DiskUsage(apps, m.cache_bytes, m.database_bytes, m.export_cache_limit_bytes)


def garbage_collected(m: device_pb2.CollectGarbageResponse) -> t.GarbageCollected:
    """Converts a garbage collection result."""
    return t.GarbageCollected(m.freed_bytes, m.removed_files, m.caches_kept_reason)


def device_status(m: device_pb2.GetDeviceStatusResponse) -> t.DeviceStatus:
    """Converts the device status."""
    b, r = m.backend, m.readings
    return t.DeviceStatus(
        backend=t.BackendStatus(
            BACKEND.py(b.backend),
            b.reason,
            b.soc_model,
            b.htp_arch,
            tuple(t.BackendAvailability(BACKEND.py(a.backend), a.usable, a.detail) for a in b.available),
            t.CpuKernels(b.cpu_kernels.active, b.cpu_kernels.detail),
        ),
        readings=t.DeviceReadings(
            _opt(r, "battery_percent"),
            _opt(r, "charging"),
            _opt(r, "temperature_celsius"),
            _opt(r, "idle"),
            r.source,
            r.read_at_ms,
        ),
        can_train=m.can_train,
        blocked_reasons=tuple(BLOCKED.py(x) for x in m.blocked_reasons),
        blocked_detail=m.blocked_detail,
        current_job_id=m.current_job_id,
        current_job_state=JOB_STATE.py(m.current_job_state),
        models=tuple(t.ModelInfo(x.name, x.family, x.parameters, x.sha256, x.is_default, x.detail) for x in m.models),
        version=m.version,
        profile=PROFILE.py(m.profile),
        profile_reason=m.profile_reason,
        unblock_hint=m.unblock_hint,
    )
