"""The watch view: a redrawn bar on a TTY, one plain line per event otherwise, and wait reasons in words."""

from __future__ import annotations

import io

from lorad.client import types as t
from lorad.client.cli.progress import ProgressView, bar, describe_wait, format_eta


def job(state: t.JobState, step: int = 0, blocked: t.BlockedReason = t.BlockedReason.NONE, detail: str = "") -> t.Job:
    p = t.JobProgress(step=step, total_steps=10, train_loss=2.0, tokens_per_second=120.0, eta_seconds=75)
    return t.Job("job_1", "", (), t.TrainingConfig(), t.DeviceRequirements(), None, state, blocked, detail, p, None,
                 "", "", "", 0, 0, 0, 0)  # fmt: skip


def update(j: t.Job, kind: t.JobEventKind, eid: int, message: str = "") -> t.JobUpdate:
    ev = t.JobEvent(eid, j.job_id, 0, kind, j.state, j.blocked_reason, j.progress, None, message, None)
    return t.JobUpdate(ev, j)


def test_helpers() -> None:
    assert format_eta(75) == "1:15" and format_eta(3725) == "1:02:05" and format_eta(None) == "?"
    assert bar(0.5, 10) == "[#####-----]" and bar(2.0, 4) == "[####]"
    waiting = job(t.JobState.WAITING, blocked=t.BlockedReason.TOO_HOT, detail="temperature 41.5 °C > 40.0 °C")
    assert describe_wait(waiting) == "waiting: temperature 41.5 °C > 40.0 °C"
    assert describe_wait(job(t.JobState.QUEUED, blocked=t.BlockedReason.OUTSIDE_WINDOW)) == "queued: outside window"


def test_plain_lines_off_tty() -> None:
    out = io.StringIO()
    v = ProgressView(out, tty=False)
    v.update(update(job(t.JobState.RUNNING), t.JobEventKind.STATE_CHANGED, 1, "started"))
    v.update(update(job(t.JobState.RUNNING, 3), t.JobEventKind.PROGRESS, 2))
    v.close()
    assert out.getvalue().splitlines() == [
        "job_1 running — started",
        "job_1 step 3/10  loss 2.000  120 tok/s  ETA 1:15",
    ]


def test_redrawn_bar_on_tty() -> None:
    out = io.StringIO()
    v = ProgressView(out, tty=True)
    v.update(update(job(t.JobState.RUNNING, 5), t.JobEventKind.PROGRESS, 1))
    v.update(update(job(t.JobState.RUNNING, 6), t.JobEventKind.PROGRESS, 2))
    v.close()
    text = out.getvalue()
    assert text.count("\r\x1b[2K") >= 2 and "step 6/10" in text and "ETA 1:15" in text and "#" in text
    assert text.endswith("\n")


def test_phase_is_shown_in_words_with_its_fraction() -> None:
    import dataclasses

    out = io.StringIO()
    v = ProgressView(out, tty=False)
    running = job(t.JobState.RUNNING)
    for eid, (phase, frac) in enumerate([(t.JobPhase.LOADING, None), (t.JobPhase.PLANNING, 0.4)], start=1):
        u = update(running, t.JobEventKind.PHASE, eid)
        v.update(dataclasses.replace(u, event=dataclasses.replace(u.event, phase=phase, phase_fraction=frac)))
    warn = update(running, t.JobEventKind.WARNING, 3, "no held-out samples (1 usable)")
    v.update(warn)
    v.close()
    assert out.getvalue().splitlines() == [
        "job_1 running",
        "job_1 loading model and data  step 0/10",
        "job_1 planning precisions 40 %  step 0/10",
        "job_1 warning: no held-out samples (1 usable)",
    ]


def test_bar_fits_80_columns_and_keeps_throughput_and_eta() -> None:
    import dataclasses

    from lorad.client.cli.progress import bar_line

    p = t.JobProgress(step=40, total_steps=100, train_loss=1.2345, eval_loss=1.8765, eval_loss_before=2.3456,
                      tokens_per_second=234.0, eta_seconds=83)  # fmt: skip
    j = dataclasses.replace(job(t.JobState.RUNNING), job_id="job_01a23baac8228e04de16", progress=p)
    for width in (60, 80, 100, 200):
        line = bar_line(j, width)
        assert len(line) <= width - 1, (width, line)
        assert line.endswith("234 tok/s  ETA 1:23"), (width, line)
        assert "[" in line and "step 40/100" in line
    wide = bar_line(j, 200)
    assert wide.startswith("job_01a23baac8228e04de16 [") and "(base 2.346)" in wide
    assert "loss 1.234" in bar_line(j, 80)  # at 80 columns only the job id and the base loss make room
