"""Pause/resume by RPC and by the condition monitor, one job on the NPU at a time, scheduled windows."""

from __future__ import annotations

import time
from datetime import UTC

import pytest

from lorad.v1 import common_pb2, jobs_pb2
from tests.integration.helpers import FINAL, GOOD_PROBE, append, create_job, get_job, tiny_config, wait_for, wait_state

pytestmark = pytest.mark.integration
S = jobs_pb2


def _events(app, job_id):
    out, after = [], 0
    while True:
        page = app.jobs.ListJobEvents(S.ListJobEventsRequest(job_id=job_id, after_event_id=after, page_size=1000),
                                      metadata=app.md)  # fmt: skip
        out += page.events
        if not page.has_more:
            return out
        after = page.events[-1].event_id


def _progress_steps(events):
    # Every step is a PROGRESS event; step 0 is the EVAL of the base model's held-out loss.
    kinds = (S.JOB_EVENT_KIND_PROGRESS, S.JOB_EVENT_KIND_EVAL)
    return [e.progress.step for e in events if e.kind == kinds[0] or (e.kind == kinds[1] and e.progress.step == 0)]


def test_pause_and_resume_by_rpc_continues_from_the_checkpoint(make_daemon) -> None:
    d = make_daemon()
    app, _ = d.register("notes")
    append(app)
    job = create_job(app, steps=60, checkpoint_every_steps=1000, eval_every_steps=1000)
    wait_for(lambda: get_job(app, job.job_id).progress.step >= 2, 60, "two steps")
    p = app.jobs.PauseJob(S.PauseJobRequest(job_id=job.job_id), metadata=app.md).job
    assert p.state in (S.JOB_STATE_PAUSING, S.JOB_STATE_PAUSED)
    p = wait_state(app, job.job_id, {S.JOB_STATE_PAUSED})
    assert p.blocked_reason == S.BLOCKED_REASON_PAUSED_BY_USER
    # The detail names the CLI verb, not an RPC (apps show it to people).
    assert p.blocked_detail == f"paused by the user; continue with `lorad jobs resume {job.job_id}`"
    at = p.progress.step
    assert 2 <= at < 60
    cks = app.jobs.ListCheckpoints(S.ListCheckpointsRequest(job_id=job.job_id), metadata=app.md).checkpoints
    assert [c.step for c in cks][-1] == at and cks[-1].size_bytes > 0
    time.sleep(0.3)
    assert get_job(app, job.job_id).progress.step == at  # paused means no training
    app.jobs.ResumeJob(S.ResumeJobRequest(job_id=job.job_id), metadata=app.md)
    done = wait_state(app, job.job_id, FINAL, 120)
    assert done.state == S.JOB_STATE_SUCCEEDED, done.error
    ev = _events(app, job.job_id)
    steps = _progress_steps(ev)
    # Step 0 is the base model's held-out loss, measured once: the resumed run does not measure it again.
    assert steps == [0, *range(1, 61)], "resume continues after the checkpoint step, no step twice"
    before = [e.progress.eval_loss_before for e in ev if e.kind == S.JOB_EVENT_KIND_EVAL and e.progress.step == 0]
    assert len(before) == 1 and before[0] > 0
    assert done.progress.eval_loss_before == before[0]
    assert any(e.message == f"resumed from checkpoint step {at}" for e in ev)
    assert [e.message for e in ev].count(f"checkpoint at step {at}") == 1, "the resume re-recorded its checkpoint"
    states = [e.state for e in ev if e.kind == S.JOB_EVENT_KIND_STATE_CHANGED]
    assert S.JOB_STATE_PAUSING in states and S.JOB_STATE_PAUSED in states


def test_a_checkpoint_written_but_not_recorded_before_a_kill_is_listed_once_resumed(make_daemon) -> None:
    # A kill -9 between writing a checkpoint file and recording it leaves the file the job resumes from, unlisted.
    d = make_daemon()
    app, _ = d.register("notes")
    append(app)
    job = create_job(app, steps=60, checkpoint_every_steps=1000, eval_every_steps=1000)
    wait_for(lambda: get_job(app, job.job_id).progress.step >= 2, 60, "two steps")
    app.jobs.PauseJob(S.PauseJobRequest(job_id=job.job_id), metadata=app.md)
    at = wait_state(app, job.job_id, {S.JOB_STATE_PAUSED}).progress.step
    loss = get_job(app, job.job_id).progress.train_loss
    d.daemon.services.jobs.drop_checkpoints(job.job_id)  # the record the kill prevented; the file stays
    listed = app.jobs.ListCheckpoints(S.ListCheckpointsRequest(job_id=job.job_id), metadata=app.md).checkpoints
    assert list(listed) == []
    app.jobs.ResumeJob(S.ResumeJobRequest(job_id=job.job_id), metadata=app.md)
    wait_for(lambda: get_job(app, job.job_id).progress.step > at, 60, "a step after the resume")
    listed = app.jobs.ListCheckpoints(S.ListCheckpointsRequest(job_id=job.job_id), metadata=app.md).checkpoints
    assert [(c.step, round(c.train_loss, 5)) for c in listed] == [(at, round(loss, 5))]
    assert listed[0].size_bytes > 0
    app.jobs.CancelJob(S.CancelJobRequest(job_id=job.job_id), metadata=app.md)


def test_condition_monitor_pauses_and_resumes_and_npu_is_exclusive(make_daemon) -> None:
    d = make_daemon()
    app, _ = d.register("notes")
    append(app)
    first = create_job(app, request_id="a", steps=60, checkpoint_every_steps=1000, eval_every_steps=1000)
    second = create_job(app, request_id="b", steps=2)
    wait_for(lambda: get_job(app, first.job_id).progress.step >= 2, 60, "first job training")
    q = get_job(app, second.job_id)
    assert q.state == S.JOB_STATE_QUEUED and q.blocked_reason == S.BLOCKED_REASON_NPU_BUSY

    d.set_probe({**GOOD_PROBE, "charging": False, "battery_percent": 20})  # unplugged, battery low
    w = wait_state(app, first.job_id, {S.JOB_STATE_WAITING}, 30)
    assert w.blocked_reason == S.BLOCKED_REASON_NOT_CHARGING and "not charging" in w.blocked_detail
    assert get_job(app, second.job_id).state == S.JOB_STATE_WAITING
    at = w.progress.step
    time.sleep(0.3)
    assert get_job(app, first.job_id).progress.step == at

    d.set_probe({**GOOD_PROBE, "temperature_celsius": 45.0})  # charging again, but too hot
    wait_for(lambda: get_job(app, first.job_id).blocked_reason == S.BLOCKED_REASON_TOO_HOT, 30, "too hot")
    d.set_probe({"charging": True})  # temperature unknown means "do not train"
    wait_for(lambda: get_job(app, first.job_id).blocked_reason == S.BLOCKED_REASON_CONDITIONS_UNKNOWN, 30, "unknown")

    d.set_probe(GOOD_PROBE)
    done = wait_state(app, first.job_id, FINAL, 120)
    assert done.state == S.JOB_STATE_SUCCEEDED
    assert _progress_steps(_events(app, first.job_id)) == [0, *range(1, 61)]
    assert wait_state(app, second.job_id, FINAL, 60).state == S.JOB_STATE_SUCCEEDED
    # One NPU owner: the second job only started after the first finished.
    assert get_job(app, second.job_id).started_at_ms >= done.finished_at_ms


def test_windows_only_queue_work(make_daemon) -> None:
    d = make_daemon()
    app, _ = d.register("notes")
    append(app)
    win = common_pb2.TrainingWindow(cron="30 2 * * *", jitter_seconds=60, timezone="Europe/Berlin")
    job = app.jobs.CreateJob(S.CreateJobRequest(request_id="w", dataset_ids=["notes"], window=win,
                                                config=tiny_config(steps=2)),
                             metadata=app.md).job  # fmt: skip
    assert job.state == S.JOB_STATE_QUEUED and job.blocked_reason == S.BLOCKED_REASON_OUTSIDE_WINDOW
    assert job.window.cron == "30 2 * * *"
    sched = d.daemon.scheduler
    aps_job = sched.aps.get_job(f"window:{job.job_id}")
    assert aps_job.coalesce and aps_job.misfire_grace_time == 12 * 3600 and aps_job.trigger.jitter == 60
    time.sleep(0.3)
    assert get_job(app, job.job_id).state == S.JOB_STATE_QUEUED  # conditions hold, but the window is closed
    # Open the window now (as if 02:30 came).
    from datetime import datetime

    d.loop.call_soon_threadsafe(lambda: aps_job.modify(next_run_time=datetime.now(UTC)))
    done = wait_state(app, job.job_id, FINAL, 60)
    assert done.state == S.JOB_STATE_SUCCEEDED
    assert sched.aps.get_job(f"window:{job.job_id}") is None  # one-shot

    sch = app.jobs.CreateSchedule(S.CreateScheduleRequest(dataset_ids=["notes"], window=win,
                                                          config=tiny_config(steps=2)),
                                  metadata=app.md).schedule  # fmt: skip
    assert sch.next_run_at_ms > time.time() * 1000
    listed = app.jobs.ListSchedules(S.ListSchedulesRequest(), metadata=app.md).schedules
    assert [s.schedule_id for s in listed] == [sch.schedule_id]
    aps_s = sched.aps.get_job(f"schedule:{sch.schedule_id}")
    d.loop.call_soon_threadsafe(lambda: aps_s.modify(next_run_time=datetime.now(UTC)))
    made = wait_for(lambda: [j for j in app.jobs.ListJobs(S.ListJobsRequest(), metadata=app.md).jobs
                             if j.schedule_id == sch.schedule_id], 30, "a job from the schedule")  # fmt: skip
    assert wait_state(app, made[0].job_id, FINAL, 60).state == S.JOB_STATE_SUCCEEDED
    assert sched.aps.get_job(f"schedule:{sch.schedule_id}") is not None  # recurring
    app.jobs.DeleteSchedule(S.DeleteScheduleRequest(schedule_id=sch.schedule_id), metadata=app.md)
    assert sched.aps.get_job(f"schedule:{sch.schedule_id}") is None
