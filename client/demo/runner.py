"""The demo, top to bottom: daemon → app → data → nightly-style job gated on the device → adapter → before/after."""

from __future__ import annotations

import datetime as dt
import math
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from lorad.client.cli.progress import ProgressView
from lorad.client.demo.daemon import PLUGGED_IN, DemoDaemon, write_probe
from lorad.client.demo.persona import PERSONA, Question, load_questions, load_samples, mentions_fact
from lorad.client.errors import LoradError
from lorad.client.sync_client import Client
from lorad.client.types import (
    BlockedReason,
    DeviceRequirements,
    Job,
    JobState,
    LoraConfig,
    Precision,
    TrainingConfig,
    TrainingWindow,
)

APP_ID = "mara-notes"
DATASET_ID = "mara"


@dataclass(frozen=True)
class DemoSettings:
    """Knobs of the demo; the defaults learn the persona visibly in a few minutes on 2 CPU cores."""

    steps: int = 80
    seq_len: int = 128
    batch_size: int = 2
    learning_rate: float = 1e-3
    rank: int = 16
    precision: Precision = Precision.FP32
    max_tokens: int = 40
    use_window: bool = True
    min_window_lead_seconds: int = 20
    keep: bool = False
    torch_threads: int = 0


@dataclass(frozen=True)
class Answer:
    """One question answered by the base model and by base + adapter."""

    question: Question
    base: str
    tuned: str


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured."""

    job: Job
    answers: tuple[Answer, ...]
    eval_loss_before: float | None
    eval_loss_after: float | None
    adapter_path: str
    adapter_sha256: str
    seconds: float
    eval_curve: tuple[tuple[int, float], ...] = ()

    @property
    def hits(self) -> tuple[int, int]:
        """Answers mentioning the expected fact: (base, adapter)."""
        base = sum(mentions_fact(a.base, a.question) for a in self.answers)
        return base, sum(mentions_fact(a.tuned, a.question) for a in self.answers)


def _loss(value: float | None) -> float | None:
    # The daemon reports NaN for a loss it did not measure.
    return None if value is None or math.isnan(value) else value


def next_window(now: dt.datetime, lead_seconds: int) -> TrainingWindow:
    """A daily cron window ("M H * * *", UTC) at the first minute boundary at least `lead_seconds` ahead."""
    start = (now.astimezone(dt.UTC) + dt.timedelta(seconds=lead_seconds + 59)).replace(second=0, microsecond=0)
    return TrainingWindow(cron=f"{start.minute} {start.hour} * * *", timezone="UTC")


def training_config(s: DemoSettings) -> TrainingConfig:
    """The demo job's training configuration."""
    return TrainingConfig(
        lora=LoraConfig(rank=s.rank, alpha=2.0 * s.rank),
        max_steps=s.steps,
        learning_rate=s.learning_rate,
        batch_size=s.batch_size,
        seq_len=s.seq_len,
        warmup_steps=max(1, s.steps // 10),
        eval_every_steps=max(1, s.steps // 3),
        checkpoint_every_steps=max(1, s.steps // 2),
        eval_fraction=0.1,
        seed=1,
        precision=s.precision,
    )


def ask(c: Client, questions: list[Question], adapter: str | None, max_tokens: int) -> list[str]:
    """Greedy answers to each question, with or without the adapter.

    No system message: the training chats have none, so the questions are rendered exactly like them.
    """
    return [
        c.generate_text(q.question, adapter=adapter, max_tokens=max_tokens, temperature=0.0).strip() for q in questions
    ]


class Demo:
    """One run of the demo, printing as it goes."""

    def __init__(self, settings: DemoSettings, out: TextIO | None = None) -> None:
        self.s = settings
        self.out = out or sys.stdout
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        """A timestamped step line."""
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.out, flush=True)

    def run(self) -> DemoResult:
        """Runs every step; the daemon is stopped and the temp dir removed (unless keep) even on failure."""
        with DemoDaemon(keep=self.s.keep, torch_threads=self.s.torch_threads) as daemon:
            self.say(f"starting a lorad daemon on {daemon.root} (fake device: unplugged, 38%)")
            daemon.start()
            try:
                return self._steps(daemon)
            except BaseException:
                print(f"--- daemon log tail ---\n{daemon.log_tail()}", file=self.out)
                raise
            finally:
                if self.s.keep:
                    self.say(f"kept {daemon.root} (daemon log: {daemon.log_file})")

    def _steps(self, daemon: DemoDaemon) -> DemoResult:
        with Client.for_owner(daemon.data_dir, target=str(daemon.socket_path)) as owner:
            status = owner.wait_ready(60)
            token = owner.register_app(APP_ID, "Mara's notes app").token
        model = next((m.name for m in status.models if m.is_default), "default model")
        self.say(f"daemon ready: lorad {status.version}, backend {status.backend.backend.value}, model {model}")
        self.say(f"registered app {APP_ID!r} (owner token from {daemon.owner_token_file.name})")
        with Client(str(daemon.socket_path), token, timeout=600) as c:
            samples = load_samples()
            r = c.append_samples(DATASET_ID, samples)
            self.say(f"submitted {r.accepted_count} of {PERSONA}'s notes and chats to dataset {DATASET_ID!r}")
            window = next_window(dt.datetime.now(dt.UTC), self.s.min_window_lead_seconds) if self.s.use_window else None
            job = c.create_job(
                [DATASET_ID],
                training_config(self.s),
                window=window,
                requirements=DeviceRequirements(require_charging=True, max_temperature_celsius=40.0),
            )
            when = f"nightly-style window {window.cron!r} UTC" if window else "no window (as soon as allowed)"
            self.say(f"job {job.job_id}: {self.s.steps} steps, rank {self.s.rank}, seq {self.s.seq_len}; {when}")
            questions = load_questions()
            self.say(f"asking the base model {len(questions)} questions about {PERSONA} while the job waits")
            base = ask(c, questions, None, self.s.max_tokens)
            job, curve = self._watch(c, job, lambda: write_probe(daemon.probe_file, PLUGGED_IN))
            if job.state is not JobState.SUCCEEDED:
                err = f": {job.error.code}: {job.error.message}" if job.error else ""
                raise LoradError(f"the demo job ended {job.state.value}{err}")
            dl = c.download_adapter(job, daemon.root, "peft")
            self.say(
                f"downloaded adapter {job.adapter_id}: {Path(dl.path).name}, {dl.size_bytes} bytes, "
                f"sha256 {dl.sha256[:16]}… verified"
            )
            tuned = ask(c, questions, job.adapter_id, self.s.max_tokens)
            adapter = c.get_adapter(job.adapter_id)
        answers = tuple(Answer(q, b, t) for q, b, t in zip(questions, base, tuned, strict=True))
        before = _loss(adapter.eval_loss_before) or _loss(job.progress.eval_loss_before)
        after = _loss(adapter.eval_loss_after) or _loss(job.progress.eval_loss)
        result = DemoResult(
            job,
            answers,
            before,
            after,
            dl.path,
            dl.sha256,
            time.monotonic() - self.t0,
            tuple(curve),
        )
        self.report(result)
        return result

    def _watch(self, c: Client, job: Job, plug_in: Callable[[], None]) -> tuple[Job, list[tuple[int, float]]]:
        view = ProgressView(self.out)
        plugged = False
        last = job
        curve: list[tuple[int, float]] = []
        try:
            for u in c.watch(job):
                view.update(u)
                last = u.job
                ev = u.event.progress.eval_loss
                if ev is not None and (not curve or curve[-1][1] != ev):
                    curve.append((u.event.progress.step, ev))
                if not plugged and u.event.blocked_reason is BlockedReason.NOT_CHARGING:
                    view.close()
                    time.sleep(1.0)  # let the waiting state be seen
                    self.say("plugging in the (fake) charger: the device is now charging, cool and idle")
                    plug_in()
                    plugged = True
        finally:
            view.close()
        if not plugged and last.state is JobState.WAITING:
            plug_in()
        return c.get_job(last.job_id), curve

    def report(self, r: DemoResult) -> None:
        """Prints the before/after answers and losses."""
        w = self.out
        print(f"\n=== What the model knows about {PERSONA}: base vs base + adapter ===", file=w)
        for a in r.answers:
            print(f"\nQ: {a.question.question}", file=w)
            for label, text in (("base   ", a.base), ("adapter", a.tuned)):
                mark = "✓" if mentions_fact(text, a.question) else "·"
                body = textwrap.shorten(text.replace("\n", " "), 110, placeholder=" …") or "(empty)"
                print(f"  {mark} {label}: {body}", file=w)
        base_hits, tuned_hits = r.hits
        print(f"\nfacts recalled: base {base_hits}/{len(r.answers)}, adapter {tuned_hits}/{len(r.answers)}", file=w)
        before = "not reported by the daemon" if r.eval_loss_before is None else f"{r.eval_loss_before:.3f}"
        after = "not reported" if r.eval_loss_after is None else f"{r.eval_loss_after:.3f}"
        print(f"held-out loss (nats/token): before {before} → after {after}", file=w)
        if r.eval_curve:
            points = " → ".join(f"step {s} {v:.3f}" for s, v in r.eval_curve)
            print(f"held-out loss during training: {points}", file=w)
        if self.s.keep:
            print(f"adapter: {r.adapter_path} (sha256 {r.adapter_sha256})", file=w)
        else:  # the file went with the temporary directory: naming its path would point at nothing
            print(
                f"adapter: sha256 {r.adapter_sha256}, removed with the demo's temporary directory "
                "(run with --keep to keep it)",
                file=w,
            )
        print(f"demo took {r.seconds:.0f} s", file=w, flush=True)
