"""Request validation: every check names the bad field path and the allowed values (→ INVALID_ARGUMENT)."""

from __future__ import annotations

import dataclasses
import math
import re
import zoneinfo
from collections.abc import Mapping, Sequence
from typing import Any

from lorad.server.engine.api import ConfigError, Knob, TrainConfig, api_key, api_knobs, job_config
from lorad.server.errors import InvalidArgument
from lorad.server.records import Requirements, SampleBody, Window

ID_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ROLES = ("system", "user", "assistant")
MAX_SAMPLES_PER_CALL = 1000
MAX_SAMPLE_BYTES = 65_536  # per text / per chat turn, UTF-8 bytes
MAX_TURNS = 256
MAX_DATASETS_PER_JOB = 64


def check_id(field: str, value: str) -> str:
    """A caller-chosen id (app, dataset).

    Raises:
        InvalidArgument: not `[a-z0-9][a-z0-9._-]{0,63}`.
    """
    if not ID_RE.fullmatch(value):
        raise InvalidArgument(field, f"{value[:80]!r} must match [a-z0-9][a-z0-9._-]{{0,63}} (lowercase, no '/')")
    return value


def check_server_id(field: str, value: str) -> str:
    """A server-assigned id (job, adapter, schedule): required and short; unknown ones are NOT_FOUND later."""
    if not value:
        raise InvalidArgument(field, "required")
    if len(value) > 128:
        raise InvalidArgument(field, "too long (at most 128 bytes)")
    return value


def check_int64(field: str, value: int) -> int:
    """A uint64 request field the store keeps as a signed 64-bit integer.

    Raises:
        InvalidArgument: above 2^63-1.
    """
    if value > 2**63 - 1:
        raise InvalidArgument(field, f"{value} is too large; at most 9,223,372,036,854,775,807")
    return value


def check_request_id(value: str) -> str:
    """CreateJob's idempotency key."""
    if not REQUEST_ID_RE.fullmatch(value):
        raise InvalidArgument("request_id", "required: 1 to 128 characters of [A-Za-z0-9._:-]")
    return value


def _text(field: str, value: str) -> None:
    if not value:
        raise InvalidArgument(field, "empty; must be 1 to 65,536 bytes of UTF-8")
    try:
        n = len(value.encode())
    except UnicodeEncodeError:
        raise InvalidArgument(field, "not valid UTF-8") from None
    if n > MAX_SAMPLE_BYTES:
        raise InvalidArgument(field, f"too long: {n} bytes > 65,536")


def check_batch_size(n: int, field: str = "samples") -> None:
    """The sample count of one call, checked before the samples are converted.

    Raises:
        InvalidArgument: 0 or more than MAX_SAMPLES_PER_CALL.
    """
    if n == 0:
        raise InvalidArgument(field, "empty; send 1 to 1,000 samples")
    if n > MAX_SAMPLES_PER_CALL:
        raise InvalidArgument(field, f"too many: {n} > 1,000 per call; split the batch")


def validate_samples(bodies: Sequence[SampleBody | None], field: str = "samples") -> None:
    """Checks a batch of samples; ``None`` stands for a sample with no content set.

    Raises:
        InvalidArgument: naming e.g. ``samples[3].chat.messages[1].role``.
    """
    if not bodies:
        raise InvalidArgument(field, "empty; send 1 to 1,000 samples")
    if len(bodies) > MAX_SAMPLES_PER_CALL:
        raise InvalidArgument(field, f"too many: {len(bodies)} > 1,000 per call; split the batch")
    for i, b in enumerate(bodies):
        path = f"{field}[{i}]"
        if b is None or (b.text is None) == (b.messages is None):
            raise InvalidArgument(path, "exactly one of text or chat must be set")
        if b.text is not None:
            _text(f"{path}.text", b.text)
            continue
        msgs = b.messages or ()
        if not msgs:
            raise InvalidArgument(f"{path}.chat.messages", "empty; a chat needs 1 to 256 turns")
        if len(msgs) > MAX_TURNS:
            raise InvalidArgument(f"{path}.chat.messages", f"too many turns: {len(msgs)} > 256")
        for j, m in enumerate(msgs):
            if m.role not in ROLES:
                raise InvalidArgument(
                    f"{path}.chat.messages[{j}].role", "unknown role; use ROLE_SYSTEM, ROLE_USER or ROLE_ASSISTANT"
                )
            _text(f"{path}.chat.messages[{j}].content", m.content)


def check_dataset_ids(field: str, ids: Sequence[str]) -> tuple[str, ...]:
    """1 to 64 distinct dataset ids."""
    if not ids:
        raise InvalidArgument(field, "empty; name 1 to 64 datasets")
    if len(ids) > MAX_DATASETS_PER_JOB:
        raise InvalidArgument(field, f"too many: {len(ids)} > 64")
    for i, d in enumerate(ids):
        check_id(f"{field}[{i}]", d)
    if len(set(ids)) != len(ids):
        raise InvalidArgument(field, "contains duplicates")
    return tuple(ids)


# The proto enum names a request may use per enum field (the valid names come from the TrainConfig declaration).
ENUM_HINTS = {
    "backend": "BACKEND_TORCH, BACKEND_ORT_CPU or BACKEND_QNN_HTP (0 = auto)",
    "precision": "PRECISION_FP32, PRECISION_BF16, PRECISION_FP16, PRECISION_W8A16 or PRECISION_W8A8 (0 = auto)",
    "lr_schedule": "LR_SCHEDULE_COSINE, LR_SCHEDULE_LINEAR or LR_SCHEDULE_CONSTANT (0 = cosine)",
}


def _given(raw: Mapping[str, Any], name: str, k: Knob, default: Any, field: str) -> Any:
    """The request's value for one TrainConfig field, or None when it is unset (0 / empty: the job default).

    Raises:
        InvalidArgument: naming ``<field>.<api path>`` and the valid range or values.
    """
    path, key = f"{field}.{k.api}", api_key(k)
    value = raw.get(key)
    if isinstance(default, bool):
        return True if value else None
    if isinstance(default, tuple):
        names = tuple(value or ())
        for i, t in enumerate(names):
            if t not in k.choices:
                raise InvalidArgument(f"{path}[{i}]", f"{t[:40]!r} unknown; one of {', '.join(k.choices)}")
        if len(set(names)) != len(names):
            raise InvalidArgument(path, "contains duplicates")
        return names or None
    if isinstance(default, str):
        name = str(value or "")
        if name and name not in k.choices:
            raise InvalidArgument(path, f"{name.split('#', 1)[-1]} is not a known value; use {ENUM_HINTS[key]}")
        return name or None
    v: float = int(value or 0) if isinstance(default, int) else float(value or 0)
    if not math.isfinite(v):
        raise InvalidArgument(path, f"{v} is not a finite number")
    if v == 0:
        return None
    if not k.admits(v):
        doc = k.api_default_doc(default)
        raise InvalidArgument(path, f"{v:g} out of range; {k.span()}" + (f" (0 = {doc})" if doc != "0" else ""))
    return v


def build_params(raw: Mapping[str, Any], field: str = "config") -> TrainConfig:
    """TrainingConfig fields (proto names; 0 = the job default) → the job's TrainConfig, every default filled in.

    Bounds, choices and job defaults are TrainConfig's own declarations (``TrainConfig.knobs``).

    Raises:
        InvalidArgument: naming e.g. ``config.lora.rank``.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    given: dict[str, Any] = {}
    for name, k in api_knobs().items():
        v = _given(raw, name, k, defaults[name], field)
        if v is not None:
            given[name] = v
    steps = given.get("steps", defaults["steps"])
    if given.get("warmup_steps", 0) >= steps:
        raise InvalidArgument(f"{field}.warmup_steps", f"{given['warmup_steps']} must be below max_steps={steps}")
    try:
        return job_config(given)
    except ConfigError as exc:  # a rule across fields; every single field was checked above
        bad = api_knobs().get(exc.errors[0].split("=", 1)[0])
        raise InvalidArgument(f"{field}.{bad.api}" if bad else field, exc.errors[0]) from None


def build_job_model(raw: Mapping[str, Any], field: str = "config") -> tuple[str, str]:
    """The request's (base_model, init_adapter_id); "" = the default model / no init adapter.

    Raises:
        InvalidArgument: either is too long.
    """
    base = str(raw.get("base_model") or "")
    if len(base) > 256:
        raise InvalidArgument(f"{field}.base_model", "too long (at most 256 bytes)")
    init_adapter = str(raw.get("init_adapter_id") or "")
    if len(init_adapter) > 128:
        raise InvalidArgument(f"{field}.init_adapter_id", "too long (at most 128 bytes)")
    return base, init_adapter


def check_precision_for_backend(params: TrainConfig, backend: str, field: str = "config") -> None:
    """A precision the job's backend cannot run is refused at CreateJob, not as a FAILED job later.

    Args:
        params: the job's parameters.
        backend: the backend the job will train on (the daemon's ``BackendDecision.for_job``).

    Raises:
        InvalidArgument: naming ``config.precision``, the backend and what it runs (from the capability table).
    """
    if params.precision == "auto":
        return
    from lorad.kernels.capabilities import capability

    cap = capability(backend)
    if params.precision not in cap.precisions:
        raise InvalidArgument(
            f"{field}.precision",
            f"{params.precision} is not run by backend {backend}; it runs {', '.join(cap.precisions)} (or leave it "
            "unset for the planner's choice)",
        )


def build_requirements(raw: Mapping[str, Any], defaults: Requirements, field: str = "requirements") -> Requirements:
    """DeviceRequirements (unset keys absent from ``raw``) → Requirements with the daemon's defaults filled in."""
    battery = int(raw.get("min_battery_percent", defaults.min_battery_percent))
    if not 0 <= battery <= 100:
        raise InvalidArgument(f"{field}.min_battery_percent", f"{battery} out of range; 0 to 100")
    temp = float(raw.get("max_temperature_celsius", defaults.max_temperature_celsius))
    if not 20 <= temp <= 80:
        raise InvalidArgument(f"{field}.max_temperature_celsius", f"{temp} out of range; 20 to 80 °C")
    return Requirements(
        require_charging=bool(raw.get("require_charging", defaults.require_charging)),
        min_battery_percent=battery,
        max_temperature_celsius=temp,
        require_idle=bool(raw.get("require_idle", defaults.require_idle)),
    )


def build_window(cron: str, jitter_seconds: int, timezone: str, field: str = "window") -> Window:
    """A TrainingWindow → Window; the cron expression and zone are parsed here so errors name the field."""
    from apscheduler.triggers.cron import CronTrigger

    if not cron:
        raise InvalidArgument(f"{field}.cron", "required: a five-field cron expression, e.g. '30 2 * * *'")
    if not 0 <= jitter_seconds <= 3600:
        raise InvalidArgument(f"{field}.jitter_seconds", f"{jitter_seconds} out of range; 0 to 3,600")
    if timezone:
        try:
            zoneinfo.ZoneInfo(timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise InvalidArgument(
                f"{field}.timezone", f"{timezone[:64]!r} is not an IANA zone, e.g. 'Europe/Berlin'"
            ) from None
    if len(cron.split()) != 5:
        raise InvalidArgument(f"{field}.cron", f"{cron[:64]!r} must have five fields: minute hour day month weekday")
    try:
        trig = CronTrigger.from_crontab(cron, timezone=timezone or None)
    except ValueError as exc:
        raise InvalidArgument(f"{field}.cron", f"{cron[:64]!r}: {exc}") from None
    from datetime import datetime

    if trig.get_next_fire_time(None, datetime.now(trig.timezone)) is None:  # e.g. 30 February
        raise InvalidArgument(f"{field}.cron", f"{cron[:64]!r} never fires (no such date); pick a day that exists")
    return Window(cron=cron, jitter_seconds=jitter_seconds, timezone=timezone)
