"""JSON encoding of domain values stored in TEXT columns."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from lorad.server.engine.api import api_key, api_knobs, job_config
from lorad.server.records import (
    CheckpointRec,
    DataSummary,
    JobSpec,
    Message,
    Phase,
    Progress,
    Requirements,
    SampleBody,
    Window,
)


def dumps(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces) so equal values hash equally."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def body_to_json(body: SampleBody) -> str:
    """A sample body as canonical JSON."""
    if body.text is not None:
        return dumps({"text": body.text})
    return dumps({"chat": [[m.role, m.content] for m in body.messages or ()]})


def body_from_json(raw: str) -> SampleBody:
    """Inverse of body_to_json."""
    d = json.loads(raw)
    if "text" in d:
        return SampleBody(text=d["text"])
    return SampleBody(messages=tuple(Message(r, c) for r, c in d["chat"]))


def content_hash(body: SampleBody) -> str:
    """SHA-256 of the canonical body: duplicates are equal bodies."""
    return hashlib.sha256(body_to_json(body).encode()).hexdigest()


def spec_to_json(spec: JobSpec) -> str:
    """A job spec as canonical JSON; its params under the API's names (the layout stored since the first version,
    so stored specs and their request_id hashes stay valid)."""
    params: dict[str, Any] = {api_key(k): getattr(spec.params, n) for n, k in api_knobs().items()}
    params |= {"base_model": spec.base_model, "init_adapter_id": spec.init_adapter_id}
    return dumps({
        "dataset_ids": list(spec.dataset_ids), "params": params, "requirements": dataclasses.asdict(spec.requirements),
        "window": dataclasses.asdict(spec.window) if spec.window else None,
    })  # fmt: skip


def spec_from_json(raw: str) -> JobSpec:
    """Inverse of spec_to_json (fields the API does not set take a job's defaults)."""
    d = json.loads(raw)
    p = dict(d["params"])
    given = {n: p[api_key(k)] for n, k in api_knobs().items() if api_key(k) in p}
    given["targets"] = tuple(given["targets"])
    return JobSpec(
        dataset_ids=tuple(d["dataset_ids"]),
        params=job_config(given),
        requirements=Requirements(**d["requirements"]),
        window=Window(**d["window"]) if d.get("window") else None,
        base_model=str(p.get("base_model", "")),
        init_adapter_id=str(p.get("init_adapter_id", "")),
    )


def spec_hash(spec: JobSpec) -> str:
    """SHA-256 of the canonical spec (request_id idempotency compares these)."""
    return hashlib.sha256(spec_to_json(spec).encode()).hexdigest()


def progress_to_json(p: Progress) -> str:
    """Progress as JSON."""
    return dumps(dataclasses.asdict(p))


def progress_from_json(raw: str) -> Progress:
    """Inverse of progress_to_json (an empty object is the zero progress; rows older than phases have none)."""
    d = json.loads(raw or "{}")
    if "phase" in d:
        d["phase"] = Phase(d["phase"])
    if d.get("data") is not None:
        data = dict(d["data"])
        data["rejected"] = tuple((str(r), int(n)) for r, n in data.get("rejected", ()))
        d["data"] = DataSummary(**data)
    return Progress(**d)


def checkpoint_to_json(c: CheckpointRec | None) -> str:
    """A checkpoint record as JSON ('' for none)."""
    return dumps(dataclasses.asdict(c)) if c is not None else ""


def checkpoint_from_json(raw: str) -> CheckpointRec | None:
    """Inverse of checkpoint_to_json."""
    return CheckpointRec(**json.loads(raw)) if raw else None
