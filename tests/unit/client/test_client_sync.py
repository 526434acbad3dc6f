"""The blocking Client against a real grpc.aio server (the daemon test double): results, errors, retries."""

from __future__ import annotations

import pytest

import lorad.client as lc
from lorad.v1 import jobs_pb2
from tests.fixtures.fake_daemon import FAST_RETRY, OWNER_TOKEN, FakeDaemon


def app_client(fake: FakeDaemon, app: str = "notes") -> lc.Client:
    return lc.Client(fake.target, fake.app_token(app), retry=FAST_RETRY, timeout=5)


def test_register_list_revoke_with_paging(fake: FakeDaemon) -> None:
    with lc.Client(fake.target, OWNER_TOKEN, retry=FAST_RETRY) as owner:
        reg = owner.register_app("notes", "Notes")
        assert isinstance(reg, lc.RegisteredApp) and reg.token and reg.app.display_name == "Notes"
        for i in range(4):
            owner.register_app(f"app{i}")
        # The double pages by 2: five apps need three pages, all gathered in id order.
        assert [a.app_id for a in owner.list_apps()] == ["app0", "app1", "app2", "app3", "notes"]
        with pytest.raises(lc.AlreadyExists):
            owner.register_app("notes")
        owner.revoke_app("notes")
        with pytest.raises(lc.NotFound):
            owner.revoke_app("nope")
    with lc.Client(fake.target, reg.token, retry=FAST_RETRY) as revoked, pytest.raises(lc.Unauthenticated):
        revoked.list_datasets()


def test_app_token_on_owner_call_is_permission_denied(fake: FakeDaemon) -> None:
    with app_client(fake) as c, pytest.raises(lc.PermissionDenied) as ei:
        c.list_apps()
    assert ei.value.exit_code == 5 and ei.value.code == "PERMISSION_DENIED"


def test_missing_token_names_where_to_set_it(fake: FakeDaemon) -> None:
    with lc.Client(fake.target, retry=FAST_RETRY) as c, pytest.raises(lc.Unauthenticated) as ei:
        c.list_datasets()
    assert "LORAD_TOKEN" in str(ei.value) and "client.toml" in str(ei.value)


def test_append_mixed_samples_and_duplicates(fake: FakeDaemon) -> None:
    with app_client(fake) as c:
        chat = lc.ChatSample((lc.ChatMessage(lc.Role.USER, "hi"), lc.ChatMessage(lc.Role.ASSISTANT, "hello")))
        r = c.append_samples("diary", ["a note", {"text": "b"}, chat, {"messages": [{"role": "user", "content": "x"}]}])
        assert (r.accepted_count, r.duplicate_count, len(r.sample_ids)) == (4, 0, 4)
        assert r.dataset is not None and r.dataset.sample_count == 4
        again = c.append_samples("diary", ["a note"])
        assert (again.accepted_count, again.duplicate_count) == (0, 1)
        assert [d.dataset_id for d in c.list_datasets()] == ["diary"]
        assert c.get_dataset("diary").sample_count == 4
        assert c.delete_dataset("diary").deleted_samples == 4
        with pytest.raises(lc.NotFound):
            c.get_dataset("diary")


def test_append_batches_over_1000_samples(fake: FakeDaemon) -> None:
    with app_client(fake) as c:
        r = c.append_samples("big", [f"sample {i}" for i in range(2500)])
    assert r.accepted_count == 2500 and len(r.sample_ids) == 2500
    assert fake.state.calls["AppendSamples"] == 3  # 1000 + 1000 + 500


def test_invalid_argument_carries_field_from_trailing_metadata(fake: FakeDaemon) -> None:
    with app_client(fake) as c, pytest.raises(lc.InvalidArgument) as ei:
        c.append_samples("d", [{"text": "ok"}, {"text": ""}])
    assert ei.value.field == "samples[1].text" and ei.value.exit_code == 4


def test_bad_sample_dict_rejected_locally_naming_the_problem() -> None:
    from lorad.client._requests import as_sample

    with pytest.raises(ValueError, match=r"messages\[0\].role='bot'"):
        as_sample({"messages": [{"role": "bot", "content": "x"}]})
    with pytest.raises(ValueError, match="'text' or a 'messages'"):
        as_sample({"body": "x"})


def test_create_job_retries_unavailable_with_one_request_id(fake: FakeDaemon) -> None:
    fake.state.fail_next["CreateJob"] = 2
    with app_client(fake) as c:
        job = c.create_job(["diary"], lc.TrainingConfig(max_steps=10, lora=lc.LoraConfig(rank=4)))
    assert fake.state.calls["CreateJob"] == 3
    assert len(set(fake.state.create_job_payloads)) == 1  # only the successful attempt reached the handler
    assert job.request_id.startswith("sdk-") and job.state is lc.JobState.QUEUED
    assert job.config.max_steps == 10 and job.config.lora.rank == 4


def test_create_job_is_idempotent_and_conflicts_on_other_payload(fake: FakeDaemon) -> None:
    with app_client(fake) as c:
        a = c.create_job(["d"], request_id="r1")
        b = c.create_job(["d"], request_id="r1")
        assert a.job_id == b.job_id
        with pytest.raises(lc.AlreadyExists):
            c.create_job(["other"], request_id="r1")


def test_retries_give_up_after_max_attempts(fake: FakeDaemon) -> None:
    fake.state.fail_next["ListJobs"] = 10
    with app_client(fake) as c, pytest.raises(lc.Unavailable) as ei:
        c.list_jobs()
    assert fake.state.calls["ListJobs"] == FAST_RETRY.max_attempts
    assert "lorad serve" in str(ei.value) and ei.value.exit_code == 6


def test_non_idempotent_call_is_not_retried(fake: FakeDaemon) -> None:
    with app_client(fake) as c:
        job = c.create_job(["d"])
        fake.state.fail_next["PauseJob"] = 1
        with pytest.raises(lc.Unavailable):
            c.pause_job(job)
        assert fake.state.calls["PauseJob"] == 1
        assert c.pause_job(job.job_id).state is lc.JobState.PAUSED
        c.cancel_job(job)
        with pytest.raises(lc.FailedPrecondition, match="CANCELLED"):
            c.pause_job(job)


def test_job_events_are_paged(fake: FakeDaemon) -> None:
    with app_client(fake) as c:
        job = c.create_job(["d"])
        for step in range(1, 6):
            fake.call(fake.jobs.add_event, job.job_id, jobs_pb2.JOB_STATE_RUNNING, step, 5, 2.0 / step)
        events = c.list_job_events(job)
        assert [e.event_id for e in events] == [1, 2, 3, 4, 5, 6]
        assert events[-1].progress.step == 5 and events[-1].kind is lc.JobEventKind.PROGRESS
        assert [e.event_id for e in c.list_job_events(job, after_event_id=4)] == [5, 6]


def test_watch_reconnects_after_a_broken_stream_without_gaps(fake: FakeDaemon) -> None:
    with app_client(fake) as c:
        job = c.create_job(["d"], request_id="w")
        for step in range(1, 5):
            fake.call(fake.jobs.add_event, job.job_id, jobs_pb2.JOB_STATE_RUNNING, step, 5, 1.0)
        fake.call(fake.jobs.add_event, job.job_id, jobs_pb2.JOB_STATE_SUCCEEDED, 5, 5, 0.5)
        fake.state.watch_cut_after_events = [2, 1]  # first stream breaks after 2 events, second after 1
        seen = [u.event.event_id for u in c.watch(job)]
        final = c.get_job(job)
    assert seen == [1, 2, 3, 4, 5, 6]
    assert fake.state.watch_after_ids == [0, 2, 3]
    assert final.is_final and final.adapter_id == f"ad_{job.job_id}"


def test_watch_follows_live_events_until_final(fake: FakeDaemon) -> None:
    import threading
    import time

    with app_client(fake) as c:
        job = c.create_job(["d"])

        def progress() -> None:
            for step in range(1, 4):
                time.sleep(0.05)
                fake.call(fake.jobs.add_event, job.job_id, jobs_pb2.JOB_STATE_RUNNING, step, 3, 1.0)
            fake.call(fake.jobs.add_event, job.job_id, jobs_pb2.JOB_STATE_SUCCEEDED, 3, 3, 1.0)

        th = threading.Thread(target=progress)
        th.start()
        updates = list(c.watch(job))
        th.join()
    assert [u.event.state for u in updates][-1] is lc.JobState.SUCCEEDED
    assert [u.event.progress.step for u in updates] == [0, 1, 2, 3, 3]


def test_watch_unknown_job_is_not_found(fake: FakeDaemon) -> None:
    with app_client(fake) as c, pytest.raises(lc.NotFound):
        list(c.watch("job_9999"))


def test_generate_streams_chunks(fake: FakeDaemon) -> None:
    with app_client(fake) as c:
        chunks = list(c.generate("what is my dog called", adapter="ad_x", max_tokens=20))
        assert chunks[0].prompt_token_count == 5
        assert chunks[-1].finish_reason is lc.FinishReason.STOP and all(x.finish_reason is None for x in chunks[:-1])
        assert "".join(x.text for x in chunks) == "echo[ad_x]: what is my dog called"
        assert c.generate_text("hi", raw=True) == "echo[base]: hi"


def test_device_status(fake: FakeDaemon) -> None:
    fake.state.can_train = False
    with app_client(fake) as c:
        st = c.device_status()
    assert st.backend.backend is lc.Backend.TORCH and st.readings.charging is True
    assert st.readings.temperature_celsius is None  # unset reading stays None, not 0.0
    assert not st.can_train and st.blocked_reasons == (lc.BlockedReason.TOO_HOT,)


def test_wait_ready_times_out_clearly(tmp_path) -> None:
    with lc.Client(str(tmp_path / "none.sock"), "t", retry=FAST_RETRY) as c, pytest.raises(lc.Unavailable):
        c.wait_ready(timeout=0.3)


def test_sync_watch_abandoned_early_does_not_hang(fake: FakeDaemon) -> None:
    with app_client(fake) as c:
        job = c.create_job(["d"])  # never finishes
        for u in c.watch(job):
            assert u.event.state is lc.JobState.QUEUED
            break
        assert c.get_job(job).state is lc.JobState.QUEUED  # the client still works after the abandoned stream


def test_wait_ready_asks_again_when_a_starting_daemon_answers_too_late(fake: FakeDaemon) -> None:
    fake.state.status_delays_s = [1.5]  # the first answer comes after that attempt's deadline (timeout / 4)
    with app_client(fake) as c:
        assert c.wait_ready(timeout=2.0).version == "fake"
    assert fake.state.calls["GetDeviceStatus"] >= 2
    fake.state.status_delays_s = [1.0] * 10  # every attempt too late: the last one's error, at the deadline
    with app_client(fake) as c, pytest.raises(lc.DeadlineExceeded):
        c.wait_ready(timeout=1.0)
