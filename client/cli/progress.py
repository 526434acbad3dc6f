"""Job progress for terminals (one redrawn bar) and for logs and pipes (one plain line per change)."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from typing import TextIO

from lorad.client.types import BlockedReason, Job, JobEventKind, JobPhase, JobState, JobUpdate


def format_eta(seconds: int | None) -> str:
    """Seconds as H:MM:SS or M:SS; "?" when unknown."""
    if seconds is None:
        return "?"
    h, rem = divmod(int(seconds), 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def describe_wait(job: Job) -> str:
    """Why a job is not running, in words, e.g. "waiting: not charging (charger disconnected)"."""
    if job.blocked_reason is BlockedReason.NONE:
        return job.state.value
    return f"{job.state.value}: {job.blocked_detail or job.blocked_reason.value.replace('_', ' ')}"


# What a running job is doing outside its training steps, in words.
PHASE_TEXT = {
    JobPhase.LOADING: "loading model and data",
    JobPhase.PLANNING: "planning precisions",
    JobPhase.EVALUATING: "measuring held-out loss",
    JobPhase.EXPORTING: "writing adapter",
}


def phase_text(job: Job) -> str:
    """The running job's phase, e.g. "planning precisions 40 %"; "" while it trains (the bar says it) or waits."""
    label = PHASE_TEXT.get(job.phase, "") if job.state in (JobState.RUNNING, JobState.PAUSING) else ""
    if label and job.phase_fraction is not None:
        label += f" {round(100 * job.phase_fraction)} %"
    return label


def _stats_parts(job: Job) -> list[tuple[str, str]]:
    """(name, text) of each progress field, in display order."""
    p = job.progress
    parts = [("step", f"step {p.step}/{p.total_steps or '?'}")]
    if p.step:
        parts.append(("loss", f"loss {p.train_loss:.3f}"))
    if p.eval_loss is not None:
        parts.append(("eval", f"eval {p.eval_loss:.3f}"))
        if p.eval_loss_before is not None:
            parts.append(("base", f"(base {p.eval_loss_before:.3f})"))
    if p.tokens_per_second:
        parts.append(("tok/s", f"{p.tokens_per_second:.0f} tok/s"))
    if job.state is JobState.RUNNING:
        parts.append(("eta", f"ETA {format_eta(p.eta_seconds)}"))
    return parts


def stats_text(job: Job) -> str:
    """Phase, step, losses, throughput and ETA of a job's latest progress."""
    p = job.progress
    if phase := phase_text(job):
        return f"{phase}  step {p.step}/{p.total_steps or '?'}"
    return "  ".join(text for _, text in _stats_parts(job))


MIN_BAR = 10  # cells: narrower than this a bar says nothing
# Dropped in this order when a terminal line is too narrow; tok/s and ETA always stay.
_DROP_ORDER = ("job", "base", "eval", "loss")


def bar_line(job: Job, width: int) -> str:
    """The live line for a terminal of ``width`` columns: bar and stats, never wider than ``width - 1``.

    When it does not fit, the job id, the base loss, the held-out loss and the training loss go first, then the bar
    shrinks to MIN_BAR cells; throughput and ETA are kept.
    """
    p = job.progress
    frac = p.step / p.total_steps if p.total_steps else 0.0
    phase = phase_text(job)
    parts = [("phase", f"{phase}  step {p.step}/{p.total_steps or '?'}")] if phase else _stats_parts(job)
    dropped: set[str] = set()
    for drop in (None, *_DROP_ORDER):
        if drop is not None:
            dropped.add(drop)
        text = "  ".join(t for k, t in parts if k not in dropped)
        prefix = "" if "job" in dropped else f"{job.job_id} "
        room = width - 1 - len(prefix) - len(text) - 3  # brackets and a space
        if room >= MIN_BAR:
            return f"{prefix}{bar(frac, min(40, room))} {text}"
    return f"{bar(frac, MIN_BAR)} {text}"[: width - 1]


def bar(fraction: float, width: int) -> str:
    """A text bar like [#####-----] of `width` cells inside the brackets."""
    done = max(0, min(width, round(fraction * width)))
    return "[" + "#" * done + "-" * (width - done) + "]"


class ProgressView:
    """Renders a stream of JobUpdates.

    On a TTY one line is redrawn in place (bar, step/total, loss, tokens/s, ETA); notices and state changes are
    printed above it. Otherwise each state change and progress event becomes one plain line (log-friendly).
    """

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.out = stream or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self._live = False
        self._last_state: JobState | None = None

    def update(self, u: JobUpdate) -> None:
        """Shows one update, as of its event (a replayed history shows each step, not the latest job)."""
        ev = u.event
        job = dataclasses.replace(
            u.job,
            state=ev.state,
            blocked_reason=ev.blocked_reason,
            progress=ev.progress,
            phase=ev.phase,
            phase_fraction=ev.phase_fraction,
        )
        if ev.state is JobState.UNSPECIFIED:
            job = u.job
        changed = ev.kind is JobEventKind.STATE_CHANGED or job.state is not self._last_state
        self._last_state = job.state
        if ev.kind in (JobEventKind.NOTICE, JobEventKind.WARNING) and ev.message:
            self._line(f"{job.job_id} {ev.kind.value}: {ev.message}")
        elif changed:
            text = describe_wait(job)
            msg = f" — {ev.message}" if ev.message and ev.message not in text and text not in ev.message else ""
            self._line(f"{job.job_id} {text}{msg}")
        error = ev.error or job.error
        p = job.progress
        if job.state is JobState.FAILED and error is not None:
            self._line(f"{job.job_id} failed: {error.code}: {error.message}")
            return
        if self.tty:
            self._redraw(job)
        elif ev.kind is JobEventKind.CHECKPOINT:
            print(f"{job.job_id} checkpoint at step {job.progress.step}", file=self.out, flush=True)
        elif ev.kind in (JobEventKind.PROGRESS, JobEventKind.PHASE) or (ev.kind is JobEventKind.EVAL and not p.step):
            # A step that ends with an evaluation sends PROGRESS (already carrying eval_loss), then EVAL: one line.
            print(f"{job.job_id} {stats_text(job)}", file=self.out, flush=True)

    def _redraw(self, job: Job) -> None:
        line = bar_line(job, shutil.get_terminal_size((100, 20)).columns)
        self.out.write("\r\x1b[2K" + line)
        self.out.flush()
        self._live = True

    def _line(self, text: str) -> None:
        if self._live:
            self.out.write("\r\x1b[2K")
            self._live = False
        print(text, file=self.out, flush=True)

    def close(self) -> None:
        """Ends the live line."""
        if self._live:
            self.out.write("\n")
            self.out.flush()
            self._live = False
