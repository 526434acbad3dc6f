"""Proto ↔ domain conversion (the only module that knows both)."""

from __future__ import annotations

from typing import Any

from lorad.server import records as d
from lorad.server.config import Config
from lorad.server.device.probes import Readings
from lorad.v1 import adapters_pb2, apps_pb2, common_pb2, data_pb2, device_pb2, jobs_pb2

ROLE_NAMES: dict[Any, str] = {
    common_pb2.ROLE_SYSTEM: "system",
    common_pb2.ROLE_USER: "user",
    common_pb2.ROLE_ASSISTANT: "assistant",
}
BACKEND_NAMES: dict[Any, str] = {
    common_pb2.BACKEND_TORCH: "torch",
    common_pb2.BACKEND_ORT_CPU: "ort-cpu",
    common_pb2.BACKEND_QNN_HTP: "qnn-htp",
}
BACKEND_ENUMS: dict[str, Any] = {v: k for k, v in BACKEND_NAMES.items()}
PROFILE_ENUMS: dict[str, Any] = {
    "phone": device_pb2.DEVICE_PROFILE_PHONE,
    "laptop": device_pb2.DEVICE_PROFILE_LAPTOP,
    "server": device_pb2.DEVICE_PROFILE_SERVER,
}
PRECISION_NAMES: dict[Any, str] = {
    common_pb2.PRECISION_FP32: "fp32",
    common_pb2.PRECISION_FP16: "fp16",
    common_pb2.PRECISION_W8A16: "w8a16",
    common_pb2.PRECISION_W8A8: "w8a8",
    common_pb2.PRECISION_BF16: "bf16",
}
PRECISION_ENUMS: dict[str, Any] = {v: k for k, v in PRECISION_NAMES.items()}
SCHEDULE_NAMES: dict[Any, str] = {
    common_pb2.LR_SCHEDULE_COSINE: "cosine",
    common_pb2.LR_SCHEDULE_LINEAR: "linear",
    common_pb2.LR_SCHEDULE_CONSTANT: "constant",
}
SCHEDULE_ENUMS: dict[str, Any] = {v: k for k, v in SCHEDULE_NAMES.items()}
FORMAT_NAMES: dict[Any, str] = {
    adapters_pb2.ADAPTER_FORMAT_UNSPECIFIED: "peft",
    adapters_pb2.ADAPTER_FORMAT_PEFT: "peft",
    adapters_pb2.ADAPTER_FORMAT_GGUF: "gguf",
    adapters_pb2.ADAPTER_FORMAT_MERGED: "merged",
}
FORMAT_ENUMS: dict[str, Any] = {
    "peft": adapters_pb2.ADAPTER_FORMAT_PEFT,
    "gguf": adapters_pb2.ADAPTER_FORMAT_GGUF,
    "merged": adapters_pb2.ADAPTER_FORMAT_MERGED,
}


def state_pb(s: d.JobState) -> Any:
    """Domain job state → JobState enum value."""
    return int(jobs_pb2.JobState.Value(f"JOB_STATE_{s.name}"))


def state_from_pb(v: Any) -> d.JobState | None:
    """JobState enum value → domain state (None for UNSPECIFIED or unknown values)."""
    name = jobs_pb2.JobState.Name(v) if v in jobs_pb2.JobState.values() else ""
    return d.JobState[name.removeprefix("JOB_STATE_")] if name and v != 0 else None


def blocked_pb(b: d.Blocked) -> Any:
    """Domain blocked reason → BlockedReason enum value."""
    return 0 if b is d.Blocked.NONE else int(jobs_pb2.BlockedReason.Value(f"BLOCKED_REASON_{b.name}"))


# -- samples -------------------------------------------------------------------------------------------------------
def sample_from_pb(s: common_pb2.Sample) -> d.SampleBody | None:
    """A Sample → SampleBody; None when no content is set. Unknown roles stay visible to validation."""
    which = s.WhichOneof("content")
    if which == "text":
        return d.SampleBody(text=s.text)
    if which == "chat":
        msgs = tuple(d.Message(ROLE_NAMES.get(m.role, f"role#{m.role}"), m.content) for m in s.chat.messages)
        return d.SampleBody(messages=msgs)
    return None


def sample_pb(b: d.SampleBody) -> common_pb2.Sample:
    """SampleBody → Sample."""
    if b.text is not None:
        return common_pb2.Sample(text=b.text)
    roles = {v: k for k, v in ROLE_NAMES.items()}
    msgs = [common_pb2.ChatMessage(role=roles[m.role], content=m.content) for m in b.messages or ()]
    return common_pb2.Sample(chat=common_pb2.Chat(messages=msgs))


def dataset_pb(x: d.Dataset) -> data_pb2.Dataset:
    """Dataset → proto."""
    return data_pb2.Dataset(
        dataset_id=x.dataset_id,
        sample_count=x.sample_count,
        size_bytes=x.size_bytes,
        created_at_ms=x.created_at_ms,
        updated_at_ms=x.updated_at_ms,
    )


def stored_sample_pb(x: d.StoredSample) -> common_pb2.StoredSample:
    """StoredSample → proto."""
    return common_pb2.StoredSample(
        sample_id=x.sample_id, created_at_ms=x.created_at_ms, size_bytes=x.size_bytes, sample=sample_pb(x.body)
    )


# -- apps ----------------------------------------------------------------------------------------------------------
def quota_from_pb(q: apps_pb2.AppQuota, cfg: Config) -> d.Quota:
    """AppQuota (zero = default) → Quota."""
    c = cfg.quotas
    return d.Quota(
        q.max_samples or c.max_samples,
        q.max_sample_bytes or c.max_sample_bytes,
        q.max_adapters or c.max_adapters,
        q.max_active_jobs or c.max_active_jobs,
    )


def app_pb(a: d.App) -> apps_pb2.App:
    """App → proto."""
    q = a.quota
    return apps_pb2.App(
        app_id=a.app_id,
        display_name=a.display_name,
        created_at_ms=a.created_at_ms,
        quota=apps_pb2.AppQuota(
            max_samples=q.max_samples,
            max_sample_bytes=q.max_sample_bytes,
            max_adapters=q.max_adapters,
            max_active_jobs=q.max_active_jobs,
        ),
        sample_count=a.sample_count,
        sample_bytes=a.sample_bytes,
        revoked=a.revoked,
    )


# -- jobs ----------------------------------------------------------------------------------------------------------
def _enum_name(names: dict[Any, str], value: int) -> str:
    """An enum value's name; "" for 0 (default); an int a client's newer proto sent stays visible to validation."""
    if value == 0:
        return ""
    return names.get(value, f"{UNKNOWN_ENUM}{value}")


UNKNOWN_ENUM = "unknown#"  # validation rejects names with this prefix, naming the field and the number


def training_raw(c: common_pb2.TrainingConfig) -> dict[str, Any]:
    """TrainingConfig → the plain dict validation.build_params checks (enum values → names, 0 = default)."""
    return {
        "base_model": c.base_model,
        "rank": c.lora.rank,
        "alpha": c.lora.alpha,
        "dropout": c.lora.dropout,
        "target_modules": list(c.lora.target_modules),
        "max_steps": c.max_steps,
        "learning_rate": c.learning_rate,
        "batch_size": c.batch_size,
        "seq_len": c.seq_len,
        "grad_accum_steps": c.grad_accum_steps,
        "warmup_steps": c.warmup_steps,
        "lr_schedule": _enum_name(SCHEDULE_NAMES, c.lr_schedule),
        "weight_decay": c.weight_decay,
        "max_grad_norm": c.max_grad_norm,
        "eval_every_steps": c.eval_every_steps,
        "checkpoint_every_steps": c.checkpoint_every_steps,
        "seed": c.seed,
        "backend": _enum_name(BACKEND_NAMES, c.backend),
        "precision": _enum_name(PRECISION_NAMES, c.precision),
        "eval_fraction": c.eval_fraction,
        "init_adapter_id": c.init_adapter_id,
        "freeze_lora_a": c.freeze_lora_a,
    }


def requirements_raw(r: common_pb2.DeviceRequirements) -> dict[str, Any]:
    """DeviceRequirements → dict of the fields that are set."""
    return {
        f: getattr(r, f)
        for f in ("require_charging", "min_battery_percent", "max_temperature_celsius", "require_idle")
        if r.HasField(f)
    }


def params_pb(spec: d.JobSpec) -> common_pb2.TrainingConfig:
    """A job's TrainConfig (and model, init adapter) → TrainingConfig with the defaults filled in."""
    p = spec.params
    return common_pb2.TrainingConfig(
        base_model=spec.base_model,
        lora=common_pb2.LoraConfig(rank=p.rank, alpha=p.alpha, dropout=p.dropout, target_modules=p.targets),
        max_steps=p.steps,
        learning_rate=p.lr,
        batch_size=p.batch_size,
        seq_len=p.seq_len,
        grad_accum_steps=p.grad_accum,
        warmup_steps=p.warmup_steps,
        lr_schedule=SCHEDULE_ENUMS.get(p.schedule, 0),
        weight_decay=p.weight_decay,
        max_grad_norm=p.max_grad_norm,
        eval_every_steps=p.eval_every,
        checkpoint_every_steps=p.checkpoint_every,
        seed=p.seed,
        backend=BACKEND_ENUMS.get(p.backend, 0),
        precision=PRECISION_ENUMS.get(p.precision, 0),
        eval_fraction=p.eval_fraction,
        init_adapter_id=spec.init_adapter_id,
        freeze_lora_a=p.freeze_lora_a,
    )


def requirements_pb(r: d.Requirements) -> common_pb2.DeviceRequirements:
    """Requirements → proto (every field set)."""
    return common_pb2.DeviceRequirements(
        require_charging=r.require_charging,
        min_battery_percent=r.min_battery_percent,
        max_temperature_celsius=r.max_temperature_celsius,
        require_idle=r.require_idle,
    )


def window_pb(w: d.Window | None) -> common_pb2.TrainingWindow | None:
    """Window → proto (None stays unset)."""
    return (
        None
        if w is None
        else common_pb2.TrainingWindow(cron=w.cron, jitter_seconds=w.jitter_seconds, timezone=w.timezone)
    )


def progress_pb(p: d.Progress) -> jobs_pb2.JobProgress:
    """Progress → proto (optional fields only when known)."""
    out = jobs_pb2.JobProgress(
        step=p.step,
        total_steps=p.total_steps,
        train_loss=p.train_loss,
        tokens_per_second=p.tokens_per_second,
        learning_rate=p.learning_rate,
        tokens_seen=p.tokens_seen,
    )
    if p.eval_loss is not None:
        out.eval_loss = p.eval_loss
    if p.eval_loss_before is not None:
        out.eval_loss_before = p.eval_loss_before
    if p.eta_seconds is not None:
        out.eta_seconds = p.eta_seconds
    if p.data is not None:
        out.data.CopyFrom(data_pb(p.data))
    return out


def data_pb(s: d.DataSummary) -> jobs_pb2.JobData:
    """DataSummary → proto (reasons the API does not name are counted as `other`)."""
    known = dict.fromkeys(d.REJECT_REASONS, 0)
    other = 0
    for reason, n in s.rejected:
        if reason in known:
            known[reason] += n
        else:
            other += n
    return jobs_pb2.JobData(
        total_samples=s.total_samples,
        train_samples=s.train_samples,
        eval_samples=s.eval_samples,
        train_tokens=s.train_tokens,
        rejected=jobs_pb2.RejectedSamples(**known, other=other),
    )


def _set_phase(out: jobs_pb2.Job | jobs_pb2.JobEvent, state: d.JobState, p: d.Progress) -> None:
    """Phase and fraction of a job that is on the NPU (a stored phase of a paused or finished job is stale)."""
    if state in (d.JobState.RUNNING, d.JobState.PAUSING) and p.phase is not d.Phase.NONE:
        out.phase = jobs_pb2.JobPhase.Value(f"JOB_PHASE_{p.phase.name}")
        if p.phase_fraction is not None:
            out.phase_fraction = p.phase_fraction


def job_pb(j: d.Job) -> jobs_pb2.Job:
    """Job → proto."""
    out = jobs_pb2.Job(
        job_id=j.job_id,
        request_id=j.request_id,
        dataset_ids=j.spec.dataset_ids,
        config=params_pb(j.spec),
        requirements=requirements_pb(j.spec.requirements),
        state=state_pb(j.state),
        blocked_reason=blocked_pb(j.blocked),
        blocked_detail=j.blocked_detail,
        progress=progress_pb(j.progress),
        adapter_id=j.adapter_id,
        backend=j.backend,
        schedule_id=j.schedule_id,
        created_at_ms=j.created_at_ms,
        started_at_ms=j.started_at_ms,
        finished_at_ms=j.finished_at_ms,
        data_until_ms=j.data_until_ms,
    )
    w = window_pb(j.spec.window)
    if w is not None:
        out.window.CopyFrom(w)
    if j.error_code:
        out.error.CopyFrom(jobs_pb2.JobError(code=j.error_code, message=j.error_message))
    _set_phase(out, j.state, j.progress)
    return out


def checkpoint_pb(c: d.CheckpointRec) -> jobs_pb2.Checkpoint:
    """CheckpointRec → proto (the path stays private)."""
    return jobs_pb2.Checkpoint(
        checkpoint_id=c.checkpoint_id,
        job_id=c.job_id,
        step=c.step,
        created_at_ms=c.created_at_ms,
        size_bytes=c.size_bytes,
        train_loss=c.train_loss,
    )


def event_pb(e: d.JobEvent) -> jobs_pb2.JobEvent:
    """JobEvent → proto."""
    out = jobs_pb2.JobEvent(
        event_id=e.event_id,
        job_id=e.job_id,
        time_ms=e.time_ms,
        kind=jobs_pb2.JobEventKind.Value(f"JOB_EVENT_KIND_{e.kind.name}"),
        state=state_pb(e.state),
        blocked_reason=blocked_pb(e.blocked),
        progress=progress_pb(e.progress),
        message=e.message,
    )
    if e.checkpoint is not None:
        out.checkpoint.CopyFrom(checkpoint_pb(e.checkpoint))
    if e.error_code:
        out.error.CopyFrom(jobs_pb2.JobError(code=e.error_code, message=e.error_message))
    _set_phase(out, e.state, e.progress)
    return out


def schedule_pb(s: d.Schedule) -> jobs_pb2.Schedule:
    """Schedule → proto."""
    out = jobs_pb2.Schedule(
        schedule_id=s.schedule_id,
        dataset_ids=s.spec.dataset_ids,
        config=params_pb(s.spec),
        requirements=requirements_pb(s.spec.requirements),
        next_run_at_ms=s.next_run_at_ms,
        created_at_ms=s.created_at_ms,
    )
    w = window_pb(s.spec.window)
    if w is not None:
        out.window.CopyFrom(w)
    return out


# -- adapters ------------------------------------------------------------------------------------------------------
def adapter_pb(a: d.AdapterRec) -> adapters_pb2.Adapter:
    """AdapterRec → proto (the path stays private)."""
    return adapters_pb2.Adapter(
        adapter_id=a.adapter_id,
        job_id=a.job_id,
        base_model=a.base_model,
        base_model_sha256=a.base_model_sha256,
        tokenizer_sha256=a.tokenizer_sha256,
        lora=common_pb2.LoraConfig(rank=a.rank, alpha=a.alpha, dropout=a.dropout, target_modules=a.target_modules),
        steps=a.steps,
        eval_loss_before=a.eval_loss_before,
        eval_loss_after=a.eval_loss_after,
        train_loss=a.train_loss,
        precision_plan=[
            adapters_pb2.LayerPrecision(
                layer=lay, forward=PRECISION_ENUMS.get(f, 0), backward=PRECISION_ENUMS.get(b, 0)
            )
            for lay, f, b in a.precision_plan
        ],
        data_until_ms=a.data_until_ms,
        sample_count=a.sample_count,
        created_at_ms=a.created_at_ms,
        size_bytes=a.size_bytes,
    )


# -- device --------------------------------------------------------------------------------------------------------
def readings_pb(r: Readings) -> device_pb2.DeviceReadings:
    """Readings → proto (unknown values stay unset)."""
    out = device_pb2.DeviceReadings(source=r.source, read_at_ms=r.read_at_ms)
    if r.battery_percent is not None:
        out.battery_percent = r.battery_percent
    if r.charging is not None:
        out.charging = r.charging
    if r.temperature_celsius is not None:
        out.temperature_celsius = r.temperature_celsius
    if r.idle is not None:
        out.idle = r.idle
    return out
