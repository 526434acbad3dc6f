"""End to end on the real trainer: register → append → create job → watch to SUCCEEDED → download → generate."""

from __future__ import annotations

import hashlib
import io
import json
import math
import tarfile

import pytest

from lorad.v1 import adapters_pb2, inference_pb2, jobs_pb2
from tests.integration.helpers import FINAL, append, create_job

pytestmark = pytest.mark.integration


def _download(stubs, adapter_id: str, fmt: int = adapters_pb2.ADAPTER_FORMAT_PEFT, offset: int = 0):
    header, chunks, offsets = None, [], []
    for msg in stubs.adapters.DownloadAdapter(
        adapters_pb2.DownloadAdapterRequest(adapter_id=adapter_id, format=fmt, read_offset=offset), metadata=stubs.md
    ):
        if msg.WhichOneof("payload") == "header":
            assert header is None
            header = msg.header
        else:
            assert header is not None, "header must come first"
            assert len(msg.chunk) <= 1024 * 1024
            offsets.append(msg.offset)
            chunks.append(msg.chunk)
    return header, b"".join(chunks), offsets


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_end_to_end(make_daemon, tcp: bool, monkeypatch) -> None:
    from lorad.server.rpc import jobs as job_service

    monkeypatch.setattr(job_service, "WATCH_PAGE", 3)  # the watch catches up in pages of 3 events
    d = make_daemon(tcp=tcp)
    app, _ = d.register("notes")
    if tcp:
        app = d.stubs(app.md[0][1].split()[1], tcp=True)
    r = append(app)
    assert r.accepted_count == 36 and r.duplicate_count == 0 and r.dataset.sample_count == 36

    job = create_job(app, steps=6)
    assert job.state in (jobs_pb2.JOB_STATE_WAITING, jobs_pb2.JOB_STATE_RUNNING, jobs_pb2.JOB_STATE_QUEUED)
    events = []
    for msg in app.jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=job.job_id), metadata=app.md, timeout=120):
        events.append(msg.event)
    assert events[-1].state == jobs_pb2.JOB_STATE_SUCCEEDED, [e.message for e in events if e.message]
    started = [e.message for e in events if e.state == jobs_pb2.JOB_STATE_RUNNING and e.message.startswith("started")]
    assert started == ["started on torch: config override (ok)"], started  # the real backend, never "the NPU"
    ids = [e.event_id for e in events]
    assert ids == sorted(set(ids))
    kinds = {e.kind for e in events}
    assert {jobs_pb2.JOB_EVENT_KIND_PROGRESS, jobs_pb2.JOB_EVENT_KIND_CHECKPOINT, jobs_pb2.JOB_EVENT_KIND_EVAL} <= kinds
    steps = [e.progress.step for e in events if e.kind == jobs_pb2.JOB_EVENT_KIND_PROGRESS]
    assert steps == sorted(steps) and max([*steps, 0]) >= 5
    final = msg.job
    assert final.state == jobs_pb2.JOB_STATE_SUCCEEDED and final.adapter_id and final.backend == "torch"
    assert final.progress.step == 6 and final.progress.train_loss > 0

    # Resuming the watch after the last event yields nothing more and ends (the job is final).
    tail = list(app.jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=job.job_id, after_event_id=ids[-1]),
                                  metadata=app.md, timeout=10))  # fmt: skip
    assert tail == []
    # ... and from the middle it continues exactly where it left off.
    mid = ids[len(ids) // 2]
    rest = [
        m.event.event_id
        for m in app.jobs.WatchJob(
            jobs_pb2.WatchJobRequest(job_id=job.job_id, after_event_id=mid), metadata=app.md, timeout=10
        )
    ]
    assert rest == [i for i in ids if i > mid]

    ad = app.adapters.GetAdapter(adapters_pb2.GetAdapterRequest(adapter_id=final.adapter_id), metadata=app.md).adapter
    assert ad.steps == 6 and ad.lora.rank == 4 and len(ad.base_model_sha256) == 64
    # The base model's held-out loss is measured before step 1 and carried to the job and the adapter.
    first = next(e for e in events if e.kind == jobs_pb2.JOB_EVENT_KIND_EVAL)
    assert first.progress.step == 0 and first.progress.HasField("eval_loss_before")
    before = first.progress.eval_loss_before
    assert math.isfinite(before) and before > 0
    assert final.progress.eval_loss_before == before and ad.eval_loss_before == before
    assert math.isfinite(ad.eval_loss_after) and ad.eval_loss_after != before

    header, blob, offsets = _download(app, final.adapter_id)
    assert header.total_size_bytes == len(blob) and hashlib.sha256(blob).hexdigest() == header.sha256
    assert offsets[0] == 0
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(tar.getnames())
        cfg = json.loads(tar.extractfile("adapter_config.json").read())
    assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"
    # Resume from an offset: the rest of the same bytes.
    h2, rest_bytes, offs2 = _download(app, final.adapter_id, offset=1000)
    assert h2.sha256 == header.sha256 and rest_bytes == blob[1000:] and offs2[0] == 1000

    pieces = list(app.inference.Generate(
        inference_pb2.GenerateRequest(adapter_id=final.adapter_id, text="Hello world", max_tokens=8),
        metadata=app.md, timeout=60))  # fmt: skip
    assert pieces[0].prompt_token_count > 0
    assert pieces[-1].finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)
    assert 1 <= pieces[-1].token_count <= 8
    assert all(p.finish_reason == 0 for p in pieces[:-1])
    assert get_state(app, job.job_id) in FINAL
    if tcp:
        return
    # The derived formats: llama.cpp GGUF LoRA and the merged model, each with its own size and digest.
    for fmt, magic in ((adapters_pb2.ADAPTER_FORMAT_GGUF, b"GGUF"), (adapters_pb2.ADAPTER_FORMAT_MERGED, None)):
        h, data, _ = _download(app, final.adapter_id, fmt=fmt)
        assert h.format == fmt and h.total_size_bytes == len(data) and hashlib.sha256(data).hexdigest() == h.sha256
        if magic:
            assert data[:4] == magic
        else:
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                assert {"config.json", "model.safetensors"} <= set(tar.getnames())
    # A chat prompt with a stop string: the text never contains the stop string.
    from lorad.v1 import common_pb2

    prompt = common_pb2.Chat(messages=[common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content="What is note 3?")])
    out = list(app.inference.Generate(
        inference_pb2.GenerateRequest(adapter_id=final.adapter_id, chat=prompt, max_tokens=12, stop=["e"]),
        metadata=app.md, timeout=60))  # fmt: skip
    text = "".join(p.text for p in out)
    assert "e" not in text and out[-1].finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED


def get_state(app, job_id):
    return app.jobs.GetJob(jobs_pb2.GetJobRequest(job_id=job_id), metadata=app.md).job.state
