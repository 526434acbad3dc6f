"""`lorad train`, `lorad jobs ...`, `lorad watch` and `lorad schedules ...`."""

from __future__ import annotations

import argparse
from typing import Any

from lorad.client.cli._context import make_client, opt
from lorad.client.cli._output import EXIT_FAILURE, EXIT_OK, EXIT_STATE, print_json, print_table, when
from lorad.client.cli.progress import ProgressView, describe_wait, stats_text
from lorad.client.sync_client import Client
from lorad.client.types import (
    Backend,
    DeviceRequirements,
    Job,
    JobState,
    LoraConfig,
    LrSchedule,
    Precision,
    TrainingConfig,
    TrainingWindow,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_parsers(sub: Any, parent: argparse.ArgumentParser) -> None:
    """Registers `train`, `jobs`, `watch` and `schedules`."""
    tr = sub.add_parser(
        "train",
        parents=[parent],
        help="train a LoRA adapter now, in the next window, or every night",
        description="Unset options take the daemon's defaults (rank 8, alpha 2*rank, all projections, "
        "100 steps, lr 2e-4, seq 256, cosine); a value out of range is an error naming the option. "
        "Device requirements default to the daemon's config.",
    )
    tr.add_argument("datasets", nargs="+", help="dataset ids to train on")
    when_g = tr.add_mutually_exclusive_group()
    when_g.add_argument("--nightly", metavar="CRON", help='recurring schedule, e.g. "30 2 * * *" (02:30 nightly)')
    when_g.add_argument("--window", metavar="CRON", help="one job that starts when this window next opens")
    tr.add_argument("--jitter", type=int, default=None, help="random delay added to each window start, seconds")
    tr.add_argument("--timezone", default="", help="IANA zone of the cron (default: device local)")
    lo = tr.add_argument_group("LoRA")
    lo.add_argument("--rank", type=int, default=None, help="adapter rank r, 1..128 (default 8)")
    lo.add_argument("--alpha", type=float, default=None, help="scale numerator, update = alpha/r, <= 4096 (default 2r)")
    lo.add_argument("--dropout", type=float, default=None, help="dropout on the LoRA input, 0..0.5")
    lo.add_argument("--targets", default="", help=f"comma-separated projections from {','.join(TARGETS)} (all)")
    op = tr.add_argument_group("training")
    op.add_argument("--base-model", default="", help="model name from `lorad status` (default model)")
    op.add_argument("--steps", type=int, default=None, help="optimizer steps, 1..100000 (default 100)")
    op.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default 2e-4)")
    op.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch, 1..64 (default 1)")
    op.add_argument("--seq-len", type=int, default=None, help="tokens per packed sequence, 16..4096 (default 256)")
    op.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step, 1..64 (default 1)")
    op.add_argument("--warmup", type=int, default=None, help="linear warmup steps")
    op.add_argument("--schedule", choices=[s.value for s in LrSchedule], default="default", help="LR decay")
    op.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay, 0..1")
    op.add_argument("--eval-every", type=int, default=None, help="held-out loss every N steps (default 25)")
    op.add_argument("--eval-fraction", type=float, default=None, help="share of samples held out (default 0.1)")
    op.add_argument("--seed", type=int, default=0)
    op.add_argument("--backend", choices=[b.value for b in Backend], default="auto")
    op.add_argument("--precision", choices=[p.value for p in Precision], default="auto")
    rq = tr.add_argument_group("device requirements (default: the daemon's config)")
    rq.add_argument("--require-charging", action=argparse.BooleanOptionalAction, default=None)
    rq.add_argument("--min-battery", type=int, default=None, help="percent, when not charging")
    rq.add_argument("--max-temp", type=float, default=None, help="degrees Celsius")
    rq.add_argument("--require-idle", action=argparse.BooleanOptionalAction, default=None)
    tr.add_argument("--request-id", default=None, help="idempotency key (default: generated)")
    tr.add_argument("--watch", action="store_true", help="follow the job's progress after creating it")
    tr.set_defaults(func=train)

    jobs = sub.add_parser("jobs", parents=[parent], help="list, show, pause, resume and cancel jobs")
    js = jobs.add_subparsers(dest="action", required=True, metavar="{list,show,pause,resume,cancel}")
    ls = js.add_parser("list", parents=[parent], help="list jobs, newest first")
    ls.add_argument(
        "--state",
        action="append",
        choices=[s.value for s in JobState if s.value != "unspecified"],
        help="only jobs in this state (repeatable)",
    )
    ls.set_defaults(func=jobs_list)
    for name, helptext in (
        ("show", "show one job with its checkpoints"),
        ("pause", "pause (checkpoint, free NPU)"),
        ("resume", "resume a paused job"),
        ("cancel", "cancel a job"),
    ):
        p = js.add_parser(name, parents=[parent], help=helptext)
        p.add_argument("job_id")
        p.set_defaults(func=jobs_action, verb=name)

    w = sub.add_parser(
        "watch",
        parents=[parent],
        help="follow a job live (progress bar on a terminal)",
        description="Exits 0 when the job succeeds, 1 when it fails, 7 when it is cancelled.",
    )
    w.add_argument("job_id")
    w.set_defaults(func=watch)

    sc = sub.add_parser("schedules", parents=[parent], help="list or delete nightly schedules")
    ss = sc.add_subparsers(dest="action", required=True, metavar="{list,delete}")
    ss.add_parser("list", parents=[parent]).set_defaults(func=schedules_list)
    sd = ss.add_parser("delete", parents=[parent])
    sd.add_argument("schedule_id")
    sd.set_defaults(func=schedules_delete)


# option dest -> (flag, lowest, highest or None, lowest excluded, highest excluded): checked before anything is sent.
# The training options mirror the daemon's TrainConfig declarations (tests/unit/client/test_cli_training_limits.py
# fails when they differ; the SDK does not import the daemon).
LIMITS: dict[str, tuple[str, float, float | None, bool, bool]] = {
    "rank": ("--rank", 1, 128, False, False),
    "alpha": ("--alpha", 0, 4096, True, False),
    "dropout": ("--dropout", 0, 0.5, False, False),
    "steps": ("--steps", 1, 100_000, False, False),
    "lr": ("--lr", 0, 1, True, True),
    "batch_size": ("--batch-size", 1, 64, False, False),
    "seq_len": ("--seq-len", 16, 4096, False, False),
    "grad_accum": ("--grad-accum", 1, 64, False, False),
    "warmup": ("--warmup", 0, None, False, False),
    "weight_decay": ("--weight-decay", 0, 1, False, False),
    "eval_every": ("--eval-every", 0, None, True, False),  # 0 would be "unset" (the daemon's 25): refused here
    "eval_fraction": ("--eval-fraction", 0, 0.5, True, False),  # likewise 0 (the daemon's 0.1)
    "jitter": ("--jitter", 0, None, False, False),
    "min_battery": ("--min-battery", 0, 100, False, False),
    "max_temp": ("--max-temp", 20, 80, False, False),
}


def _span(lo: float, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if hi is not None and not lo_open and not hi_open:
        return f"{lo:g} to {hi:g}"
    low = f"{'>' if lo_open else '≥'} {lo:g}"
    return low if hi is None else f"{low} and {'<' if hi_open else '≤'} {hi:g}"


def check_limits(args: argparse.Namespace) -> None:
    """Rejects a given option outside its range, naming it: "--steps must be 1 to 100000, got -5".

    Raises:
        ValueError: The first option out of range.
    """
    for dest, (flag, lo, hi, lo_open, hi_open) in LIMITS.items():
        v = getattr(args, dest, None)
        if v is None:
            continue
        below = (v <= lo) if lo_open else (v < lo)
        above = hi is not None and ((v >= hi) if hi_open else (v > hi))
        if below or above:
            raise ValueError(f"{flag} must be {_span(lo, hi, lo_open, hi_open)}, got {v:g}")


def training_config(args: argparse.Namespace) -> TrainingConfig:
    """The TrainingConfig the train options describe (unset options are 0: the daemon's defaults).

    Raises:
        ValueError: An option is out of range, or a --targets entry is unknown (names the allowed ones).
    """
    check_limits(args)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"--targets: unknown {', '.join(bad)}; allowed: {', '.join(TARGETS)}")
    return TrainingConfig(
        base_model=args.base_model,
        lora=LoraConfig(args.rank or 0, args.alpha or 0.0, args.dropout or 0.0, targets),
        max_steps=args.steps or 0,
        learning_rate=args.lr or 0.0,
        batch_size=args.batch_size or 0,
        seq_len=args.seq_len or 0,
        grad_accum_steps=args.grad_accum or 0,
        warmup_steps=args.warmup or 0,
        lr_schedule=LrSchedule(args.schedule),
        weight_decay=args.weight_decay or 0.0,
        eval_every_steps=args.eval_every or 0,
        eval_fraction=args.eval_fraction or 0.0,
        seed=args.seed,
        backend=Backend(args.backend),
        precision=Precision(args.precision),
    )


def train(args: argparse.Namespace) -> int:
    """Creates a job or a schedule."""
    config = training_config(args)
    req = DeviceRequirements(args.require_charging, args.min_battery, args.max_temp, args.require_idle)
    cron = args.nightly or args.window
    window = TrainingWindow(cron, args.jitter or 0, args.timezone) if cron else None
    with make_client(args) as c:
        if args.nightly:
            assert window is not None
            s = c.create_schedule(args.datasets, window, config, requirements=req)
            if opt(args, "json"):
                print_json(s)
            else:
                print(
                    f"schedule {s.schedule_id}: {window.cron!r} on {', '.join(args.datasets)}; "
                    f"next run {when(s.next_run_at_ms)}"
                )
            return EXIT_OK
        job = c.create_job(args.datasets, config, requirements=req, window=window, request_id=args.request_id)
        if opt(args, "json") and not args.watch:
            print_json(job)
            return EXIT_OK
        if not opt(args, "json"):
            print(f"job {job.job_id} {describe_wait(job)}")
        return _follow(c, job, bool(opt(args, "json"))) if args.watch else EXIT_OK


def _final_code(job: Job) -> int:
    return {JobState.SUCCEEDED: EXIT_OK, JobState.CANCELLED: EXIT_STATE}.get(job.state, EXIT_FAILURE)


def _follow(c: Client, job: Job, as_json: bool) -> int:
    last = job
    if as_json:
        for u in c.watch(job):
            print_json({"event": u.event, "job": u.job})
            last = u.job
        return _final_code(last)
    view = ProgressView()
    try:
        for u in c.watch(job):
            view.update(u)
            last = u.job
    finally:
        view.close()
    if last.state is JobState.SUCCEEDED:
        p = last.progress
        losses = (
            f"held-out loss {p.eval_loss_before:.3f} -> {p.eval_loss:.3f}; "
            if (p.eval_loss is not None and p.eval_loss_before is not None)
            else ""
        )
        print(f"{last.job_id} succeeded: {losses}adapter {last.adapter_id} (`lorad adapters pull {last.adapter_id}`)")
    return _final_code(last)


def watch(args: argparse.Namespace) -> int:
    """Follows a job until it is final."""
    with make_client(args) as c:
        return _follow(c, c.get_job(args.job_id), bool(opt(args, "json")))


def jobs_list(args: argparse.Namespace) -> int:
    """Lists jobs."""
    with make_client(args) as c:
        jobs = c.list_jobs([JobState(s) for s in args.state or ()])
    if opt(args, "json"):
        print_json(jobs)
    else:
        rows = [
            (
                j.job_id,
                describe_wait(j),
                f"{j.progress.step}/{j.progress.total_steps}",
                j.adapter_id,
                when(j.created_at_ms),
            )
            for j in jobs
        ]
        print_table(rows, ("JOB", "STATE", "STEP", "ADAPTER", "CREATED"))
    return EXIT_OK


def jobs_action(args: argparse.Namespace) -> int:
    """show / pause / resume / cancel."""
    with make_client(args) as c:
        if args.verb == "show":
            job = c.get_job(args.job_id)
            cps = c.list_checkpoints(job)
            if opt(args, "json"):
                print_json({"job": job, "checkpoints": cps})
                return EXIT_OK
            _print_job(job)
            for cp in cps:
                print(f"  checkpoint {cp.checkpoint_id} at step {cp.step} (loss {cp.train_loss:.3f})")
            return EXIT_OK
        job = {"pause": c.pause_job, "resume": c.resume_job, "cancel": c.cancel_job}[args.verb](args.job_id)
    if opt(args, "json"):
        print_json(job)
    else:
        print(f"{job.job_id} {describe_wait(job)}")
    return EXIT_OK


def _print_job(j: Job) -> None:
    print(f"job       {j.job_id}  ({describe_wait(j)})")
    print(f"datasets  {', '.join(j.dataset_ids)}")
    print(f"progress  {stats_text(j)}")
    cfg = j.config
    print(
        f"config    model {cfg.base_model or 'default'}, rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g}, "
        f"steps {cfg.max_steps}, lr {cfg.learning_rate:g}, seq {cfg.seq_len}, backend {j.backend or '-'}"
    )
    if j.window:
        print(f"window    {j.window.cron!r}")
    if j.error:
        print(f"error     {j.error.code}: {j.error.message}")
    if j.adapter_id:
        print(f"adapter   {j.adapter_id}")
    print(f"created   {when(j.created_at_ms)}  started {when(j.started_at_ms)}  finished {when(j.finished_at_ms)}")


def schedules_list(args: argparse.Namespace) -> int:
    """Lists schedules."""
    with make_client(args) as c:
        ss = c.list_schedules()
    if opt(args, "json"):
        print_json(ss)
    else:
        rows = [
            (s.schedule_id, s.window.cron if s.window else "-", ",".join(s.dataset_ids), when(s.next_run_at_ms))
            for s in ss
        ]
        print_table(rows, ("SCHEDULE", "CRON", "DATASETS", "NEXT RUN"))
    return EXIT_OK


def schedules_delete(args: argparse.Namespace) -> int:
    """Deletes a schedule."""
    with make_client(args) as c:
        c.delete_schedule(args.schedule_id)
    if opt(args, "json"):
        print_json({"deleted": args.schedule_id})
    else:
        print(f"deleted schedule {args.schedule_id}")
    return EXIT_OK
