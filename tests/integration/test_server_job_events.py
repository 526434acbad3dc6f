"""Job events over gRPC: a PROGRESS for every step, typed phases, typed rejected counts, a non-empty held-out set."""

from __future__ import annotations

import pytest

from lorad.v1 import jobs_pb2
from tests.integration.helpers import FINAL, append, chat, create_job, get_job, wait_for, wait_state

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


def test_every_step_has_progress_phases_are_typed_and_rejections_are_counted(make_daemon) -> None:
    d = make_daemon()
    app, _ = d.register("notes")
    samples = [chat(f"What is note {i}?", f"Note {i} is a fox.") for i in range(3)]
    samples.append(chat("word " * 200, "too long for seq_len 64"))
    append(app, samples=samples)
    job = create_job(app, steps=5, eval_every_steps=2, eval_fraction=0.05, checkpoint_every_steps=100)
    done = wait_state(app, job.job_id, FINAL, 120)
    assert done.state == S.JOB_STATE_SUCCEEDED, done.error
    ev = _events(app, job.job_id)

    steps = [e.progress.step for e in ev if e.kind == S.JOB_EVENT_KIND_PROGRESS]
    assert steps == [1, 2, 3, 4, 5], "a step that ends with an evaluation reports PROGRESS too"
    assert [e.progress.step for e in ev if e.kind == S.JOB_EVENT_KIND_EVAL] == [0, 2, 4, 5]
    assert all(e.phase == S.JOB_PHASE_TRAINING and e.phase_fraction == pytest.approx(e.progress.step / 5)
               for e in ev if e.kind == S.JOB_EVENT_KIND_PROGRESS)  # fmt: skip

    phases = [e.phase for e in ev if e.kind == S.JOB_EVENT_KIND_PHASE]
    # A cold "auto" job (no plan cached for the model yet) measures the plan last, after its adapter is exported.
    cold = any(e.kind == S.JOB_EVENT_KIND_NOTICE and e.message.startswith("no precision plan") for e in ev)
    assert phases[0] == S.JOB_PHASE_LOADING and phases[-1] == (S.JOB_PHASE_PLANNING if cold else S.JOB_PHASE_EXPORTING)
    assert S.JOB_PHASE_PLANNING not in phases[: phases.index(S.JOB_PHASE_EXPORTING)], "no job waits for planning"
    assert phases.count(S.JOB_PHASE_EVALUATING) == 4, "the loss before training and after steps 2, 4, 5"
    assert all(not e.HasField("phase_fraction") for e in ev if e.phase == S.JOB_PHASE_LOADING)

    # The data notice comes when the data is prepared (before the first step), with typed counts.
    (data_ev,) = [e for e in ev if e.kind == S.JOB_EVENT_KIND_NOTICE and e.message.startswith("data:")]
    first_step = next(e.event_id for e in ev if e.kind == S.JOB_EVENT_KIND_PROGRESS)
    assert data_ev.event_id < first_step
    data = data_ev.progress.data
    assert data.total_samples == 4 and data.rejected.too_long == 1 and data.rejected.empty == 0
    # Three usable samples and a 5 % split: the tiny set still holds one sample out, so losses are reported.
    assert (data.train_samples, data.eval_samples) == (2, 1)
    assert done.progress.HasField("eval_loss") and done.progress.HasField("eval_loss_before")
    assert done.progress.data == data, "the job keeps its data summary"
    # Tokens count the samples' own, not padding: a step of 2 sequences here is whole epochs of the two short samples.
    seen = [e.progress.tokens_seen for e in ev if e.kind == S.JOB_EVENT_KIND_PROGRESS]
    per_step = seen[0]
    assert seen == [k * per_step for k in range(1, 6)] and done.progress.tokens_seen == seen[-1]
    assert per_step % data.train_tokens == 0 and per_step < 2 * 64, (per_step, data.train_tokens)
    assert not [e for e in ev if e.kind == S.JOB_EVENT_KIND_WARNING]
    # A finished job is in no phase.
    assert done.phase == S.JOB_PHASE_UNSPECIFIED and not done.HasField("phase_fraction")


def test_a_running_job_reports_its_phase(make_daemon) -> None:
    d = make_daemon()
    app, _ = d.register("notes")
    append(app)
    job = create_job(app, steps=400, eval_every_steps=1000, checkpoint_every_steps=1000)

    running = wait_for(lambda: (j := get_job(app, job.job_id)).progress.step >= 1 and j, 60, "a step")
    assert running.phase == S.JOB_PHASE_TRAINING and 0 < running.phase_fraction <= 1
    app.jobs.CancelJob(S.CancelJobRequest(job_id=job.job_id), metadata=app.md)
    assert wait_state(app, job.job_id, FINAL, 60).phase == S.JOB_PHASE_UNSPECIFIED


def test_one_usable_sample_gives_a_warning_event(make_daemon) -> None:
    d = make_daemon()
    app, _ = d.register("notes")
    append(app, samples=[chat("What is note 1?", "Note 1 is a fox.")])
    job = create_job(app, steps=2)
    done = wait_state(app, job.job_id, FINAL, 120)
    assert done.state == S.JOB_STATE_SUCCEEDED, done.error
    warnings = [e for e in _events(app, job.job_id) if e.kind == S.JOB_EVENT_KIND_WARNING]
    assert len(warnings) == 1 and "no held-out samples" in warnings[0].message
