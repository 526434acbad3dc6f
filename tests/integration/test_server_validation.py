"""Bad inputs get the documented status codes, name the field, and change nothing stored."""

from __future__ import annotations

import grpc
import pytest

from lorad.v1 import adapters_pb2, common_pb2, data_pb2, jobs_pb2
from tests.integration.helpers import FINAL, append, chat, code_of, corpus, create_job, tiny_config, wait_state

pytestmark = pytest.mark.integration
IA = grpc.StatusCode.INVALID_ARGUMENT


def _count(app, ds: str = "notes") -> int:
    try:
        return app.data.GetDataset(data_pb2.GetDatasetRequest(dataset_id=ds), metadata=app.md).dataset.sample_count
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND
        return -1


def _raw_append(channel, md, raw: bytes):
    call = channel.unary_unary("/lorad.v1.DataService/AppendSamples", request_serializer=lambda b: b,
                               response_deserializer=data_pb2.AppendSamplesResponse.FromString)  # fmt: skip
    return call(raw, metadata=md)


def test_samples_validation_quota_and_duplicates(make_daemon) -> None:
    d = make_daemon()
    app, _ = d.register("notes", max_samples=40, max_sample_bytes=100_000)
    first = append(app, samples=corpus(4))
    assert first.accepted_count == 6
    bad_role = common_pb2.Sample(
        chat=common_pb2.Chat(
            messages=[
                common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content="hi"),
                common_pb2.ChatMessage(role=9, content="x"),
            ]
        )
    )
    cases = [
        ([common_pb2.Sample(text="ok"), common_pb2.Sample(text="")], "samples[1].text"),
        ([common_pb2.Sample(text="ok"), bad_role], "samples[1].chat.messages[1].role"),
        ([common_pb2.Sample()], "samples[0]"),
        ([common_pb2.Sample(text="x" * 70_000)], "samples[0].text"),
        ([common_pb2.Sample(text=f"s{i}") for i in range(1001)], "samples"),
        ([common_pb2.Sample(chat=common_pb2.Chat())], "samples[0].chat.messages"),
        ([chat("", "a")], "samples[0].chat.messages[0].content"),
    ]  # fmt: skip
    for samples, field in cases:
        code, msg, trailing = code_of(lambda s=samples: append(app, samples=s))
        assert code == IA and trailing["lorad-error-field"] == field and msg.startswith(field), (field, msg)
        assert _count(app) == 6
    code, _, trailing = code_of(lambda: append(app, dataset="Bad/Name"))
    assert code == IA and trailing["lorad-error-field"] == "dataset_id"
    # Invalid UTF-8 cannot be built with the Python API; send raw bytes: field 1 dataset "notes", field 2 sample
    # {text: b"\xff\xfe"}.
    inner = b"\x0a\x02\xff\xfe"
    raw = b"\x0a\x05notes" + b"\x12" + bytes([len(inner)]) + inner
    code, msg, trailing = code_of(lambda: _raw_append(app.channel, app.md, raw))
    assert code == IA and trailing["lorad-error-field"] == "samples[0].text" and "UTF-8" in msg
    assert _count(app) == 6

    # Duplicates are detected (also within one request) and keep their ids; retries are safe.
    again = append(app, samples=[*corpus(4)[:2], common_pb2.Sample(text="new one"), common_pb2.Sample(text="new one")])
    assert (again.accepted_count, again.duplicate_count) == (1, 3)
    assert list(again.sample_ids[:2]) == list(first.sample_ids[:2]) and again.sample_ids[2] == again.sample_ids[3]
    assert _count(app) == 7
    # Quotas: count and bytes; all-or-nothing.
    code, msg, _ = code_of(lambda: append(app, samples=[common_pb2.Sample(text=f"q{i}") for i in range(34)]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_samples=40" in msg
    code, msg, _ = code_of(lambda: append(app, samples=[common_pb2.Sample(text="y" * 60_000)] * 1 +
                                           [common_pb2.Sample(text="z" * 60_000)]))  # fmt: skip
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sample_bytes" in msg
    assert _count(app) == 7

    # Streaming: each message commits; a bad later message keeps the committed prefix.
    def stream():
        yield data_pb2.StreamSamplesRequest(dataset_id="streamed", samples=[common_pb2.Sample(text="a1")])
        yield data_pb2.StreamSamplesRequest(samples=[common_pb2.Sample(text="a2"), common_pb2.Sample(text="a1")])

    r = app.data.StreamSamples(stream(), metadata=app.md)
    assert (r.accepted_count, r.duplicate_count, r.dataset.sample_count) == (2, 1, 2)

    def bad_stream():
        yield data_pb2.StreamSamplesRequest(dataset_id="streamed", samples=[common_pb2.Sample(text="a3")])
        yield data_pb2.StreamSamplesRequest(dataset_id="other", samples=[common_pb2.Sample(text="a4")])

    code, _, trailing = code_of(lambda: app.data.StreamSamples(bad_stream(), metadata=app.md))
    assert code == IA and trailing["lorad-error-field"] == "dataset_id"
    assert _count(app, "streamed") == 3
    # Paging: page_size 2 over 7 samples, in commit order, no repeats.
    seen, token = [], ""
    while True:
        page = app.data.ListSamples(data_pb2.ListSamplesRequest(dataset_id="notes", page_size=2, page_token=token),
                                    metadata=app.md)  # fmt: skip
        seen += [s.sample_id for s in page.samples]
        token = page.next_page_token
        if not token:
            break
    assert len(seen) == 7 == len(set(seen))
    code, _, trailing = code_of(
        lambda: app.data.ListSamples(data_pb2.ListSamplesRequest(dataset_id="notes", page_token="!!"), metadata=app.md)
    )
    assert code == IA and trailing["lorad-error-field"] == "page_token"
    assert (
        app.data.DeleteDataset(data_pb2.DeleteDatasetRequest(dataset_id="streamed"), metadata=app.md).deleted_samples
        == 3
    )


def test_jobs_validation_idempotency_transitions_quota(make_daemon) -> None:
    d = make_daemon(probe_values={"charging": False, "battery_percent": 10, "temperature_celsius": 30.0})
    app, _ = d.register("notes", max_active_jobs=2)
    append(app)
    bad = [
        (dict(lora=common_pb2.LoraConfig(rank=500)), "config.lora.rank"),
        (dict(learning_rate=2.0), "config.learning_rate"),
        (dict(seq_len=8), "config.seq_len"),
        (dict(warmup_steps=10), "config.warmup_steps"),
        (dict(lora=common_pb2.LoraConfig(target_modules=["wq"])), "config.lora.target_modules[0]"),
        (dict(base_model="gpt-9"), "config.base_model"),
    ]
    for cfg, field in bad:
        code, _, trailing = code_of(lambda c=cfg: app.jobs.CreateJob(jobs_pb2.CreateJobRequest(
            request_id="bad", dataset_ids=["notes"], config=tiny_config(**c)), metadata=app.md))  # fmt: skip
        assert code == IA and trailing["lorad-error-field"] == field, field
    for req, field in (
        (jobs_pb2.CreateJobRequest(request_id="", dataset_ids=["notes"]), "request_id"),
        (jobs_pb2.CreateJobRequest(request_id="x", dataset_ids=[]), "dataset_ids"),
        (jobs_pb2.CreateJobRequest(request_id="x", dataset_ids=["notes"],
                                   requirements=common_pb2.DeviceRequirements(max_temperature_celsius=99)),
         "requirements.max_temperature_celsius"),
        (jobs_pb2.CreateJobRequest(request_id="x", dataset_ids=["notes"],
                                   window=common_pb2.TrainingWindow(cron="61 2 * * *")), "window.cron"),
        (jobs_pb2.CreateJobRequest(request_id="x", dataset_ids=["notes"],
                                   window=common_pb2.TrainingWindow(cron="1 2 * * *", timezone="Mars/Base")),
         "window.timezone"),
    ):  # fmt: skip
        code, _, trailing = code_of(lambda r=req: app.jobs.CreateJob(r, metadata=app.md))
        assert code == IA and trailing["lorad-error-field"] == field, field
    code, msg, _ = code_of(lambda: create_job(app, datasets=("missing",)))
    assert code == grpc.StatusCode.NOT_FOUND and "missing" in msg
    assert list(app.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=app.md).jobs) == []

    # Battery low and not charging: the job waits and says why.
    job = create_job(app, request_id="r1")
    assert job.state == jobs_pb2.JOB_STATE_WAITING and job.blocked_reason == jobs_pb2.BLOCKED_REASON_NOT_CHARGING
    assert "not charging" in job.blocked_detail
    # Idempotent retry; a different payload under the same request_id is refused.
    assert create_job(app, request_id="r1").job_id == job.job_id
    code, msg, _ = code_of(lambda: create_job(app, request_id="r1", steps=9))
    assert code == grpc.StatusCode.ALREADY_EXISTS and job.job_id in msg
    # Illegal transitions name the current state.
    code, msg, _ = code_of(lambda: app.jobs.ResumeJob(jobs_pb2.ResumeJobRequest(job_id=job.job_id), metadata=app.md))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "WAITING" in msg
    paused = app.jobs.PauseJob(jobs_pb2.PauseJobRequest(job_id=job.job_id), metadata=app.md).job
    assert paused.state == jobs_pb2.JOB_STATE_PAUSED and paused.blocked_reason == jobs_pb2.BLOCKED_REASON_PAUSED_BY_USER
    resumed = app.jobs.ResumeJob(jobs_pb2.ResumeJobRequest(job_id=job.job_id), metadata=app.md).job
    assert resumed.state == jobs_pb2.JOB_STATE_WAITING
    # Quota on active jobs.
    create_job(app, request_id="r2")
    code, msg, _ = code_of(lambda: create_job(app, request_id="r3"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_active_jobs=2" in msg
    c = app.jobs.CancelJob(jobs_pb2.CancelJobRequest(job_id=job.job_id), metadata=app.md).job
    assert c.state == jobs_pb2.JOB_STATE_CANCELLED and c.finished_at_ms > 0
    code, msg, _ = code_of(lambda: app.jobs.CancelJob(jobs_pb2.CancelJobRequest(job_id=job.job_id), metadata=app.md))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "CANCELLED" in msg
    code, msg, _ = code_of(lambda: app.jobs.PauseJob(jobs_pb2.PauseJobRequest(job_id=job.job_id), metadata=app.md))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "CANCELLED" in msg
    # Events are paged.
    page = app.jobs.ListJobEvents(jobs_pb2.ListJobEventsRequest(job_id=job.job_id, page_size=2), metadata=app.md)
    assert len(page.events) == 2 and page.has_more
    rest = app.jobs.ListJobEvents(jobs_pb2.ListJobEventsRequest(job_id=job.job_id, page_size=100,
                                  after_event_id=page.events[-1].event_id), metadata=app.md)  # fmt: skip
    assert not rest.has_more and rest.events[-1].state == jobs_pb2.JOB_STATE_CANCELLED
    code, _, trailing = code_of(lambda: app.jobs.ListJobs(jobs_pb2.ListJobsRequest(states=[42]), metadata=app.md))
    assert code == IA and trailing["lorad-error-field"] == "states[0]"


def test_failing_job_records_error_and_daemon_lives(make_daemon) -> None:
    d = make_daemon()
    app, _ = d.register("notes")
    # Every chat renders longer than seq_len=16, so nothing is trainable.
    append(app, samples=[chat(f"a long question number {i} " * 3, "a long answer " * 4) for i in range(5)])
    job = create_job(app, seq_len=16)
    job = wait_state(app, job.job_id, FINAL)
    assert job.state == jobs_pb2.JOB_STATE_FAILED and job.error.code == "no_usable_samples"
    assert "too_long" in job.error.message and "question" not in job.error.message
    # The daemon still serves and trains.
    append(app, dataset="ok")
    ok = wait_state(app, create_job(app, request_id="r2", datasets=("ok",), steps=2).job_id, FINAL)
    assert ok.state == jobs_pb2.JOB_STATE_SUCCEEDED
    code, _, trailing = code_of(lambda: list(app.adapters.DownloadAdapter(adapters_pb2.DownloadAdapterRequest(
        adapter_id=ok.adapter_id, read_offset=10**9), metadata=app.md)))  # fmt: skip
    assert code == IA and trailing["lorad-error-field"] == "read_offset"


def test_precision_the_backend_cannot_run_is_refused_at_create(make_daemon) -> None:
    """fp16 on the torch backend used to be accepted, go RUNNING, then FAIL internal; now CreateJob refuses it."""
    d = make_daemon()
    a, _ = d.register("alpha")
    append(a, samples=corpus(12))
    with pytest.raises(grpc.RpcError) as e:
        create_job(a, "bad", precision=common_pb2.PRECISION_W8A16, backend=common_pb2.BACKEND_ORT_CPU)
    assert e.value.code() == IA and "config.precision" in str(e.value.details())
    assert "ort-cpu" in str(e.value.details()) and "w8a8" in str(e.value.details())
    assert not a.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=a.md).jobs  # nothing stored
    # bf16 is in the API and accepted where the backend runs it (torch runs it, natively or by rounding).
    job = create_job(a, "ok", precision=common_pb2.PRECISION_BF16, backend=common_pb2.BACKEND_TORCH)
    assert job.job_id
