"""`lorad adapters ...`, `lorad generate`, `lorad status` and `lorad serve`."""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time
from typing import Any

from lorad.client.cli._chat import add_sampling_args, sampling_kwargs
from lorad.client.cli._context import make_client, opt
from lorad.client.cli._output import EXIT_FAILURE, EXIT_OK, human_bytes, print_json, print_table, to_jsonable, when
from lorad.client.cli.progress import bar, describe_wait, stats_text
from lorad.client.types import AdapterFormat, DeviceStatus, Job


def add_parsers(sub: Any, parent: argparse.ArgumentParser) -> None:
    """Registers `adapters`, `generate`, `status` and `serve`."""
    ad = sub.add_parser("adapters", parents=[parent], help="list, pull (download) and delete adapters")
    ads = ad.add_subparsers(dest="action", required=True, metavar="{list,show,pull,delete}")
    ads.add_parser("list", parents=[parent], help="list adapters, newest first").set_defaults(func=adapters_list)
    sh = ads.add_parser("show", parents=[parent], help="show one adapter (a summary; --layers: each layer)")
    sh.add_argument("adapter_id", help="adapter id, or a job id (job_...) whose adapter to show")
    sh.add_argument("--layers", action="store_true", help="list the precision plan of every layer")
    sh.set_defaults(func=adapters_show)
    pull = ads.add_parser(
        "pull",
        parents=[parent],
        help="download an adapter (sha256-verified, resumable)",
        description="Bytes go to <path>.part; an interrupted pull resumes from it when run again.",
    )
    pull.add_argument("adapter", help="adapter id, or a job id (job_...) whose adapter to pull")
    pull.add_argument(
        "-o", "--output", default=".", help="file, or directory (created when the path ends in /; default: .)"
    )
    pull.add_argument(
        "--format",
        choices=[f.value for f in AdapterFormat],
        default="peft",
        help="peft: tar of the PEFT folder; gguf: llama.cpp --lora file; merged: tar of a full model",
    )
    pull.add_argument("--force", action="store_true", help="overwrite an existing file")
    pull.set_defaults(func=adapters_pull)
    de = ads.add_parser(
        "delete",
        parents=[parent],
        help="delete an adapter and its exports (asks first)",
        description="Asks for confirmation on a terminal; without one (scripts, pipes) --yes is required.",
    )
    de.add_argument("adapter_id", help="adapter id, or a job id (job_...) whose adapter to delete")
    de.add_argument("-y", "--yes", action="store_true", help="delete without asking")
    de.add_argument(
        "--cancel-dependents",
        action="store_true",
        help="also cancel unfinished jobs and delete schedules that start from the adapter",
    )
    de.set_defaults(func=adapters_delete)

    gen = sub.add_parser("generate", parents=[parent], help="generate text with the base model or an adapter")
    gen.add_argument("prompt", help="the user's message ('-' reads stdin)")
    gen.add_argument("--adapter", default=None, help="adapter id or job id (default: base model only)")
    gen.add_argument(
        "--with-adapter",
        action="append",
        default=[],
        metavar="ADAPTER",
        help="another adapter applied with --adapter, e.g. a federated global one",
    )
    gen.add_argument("--system", default=None, help="a system message before the prompt")
    gen.add_argument("--raw", action="store_true", help="continue the prompt as plain text (no chat template)")
    add_sampling_args(gen)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.set_defaults(func=generate)

    sub.add_parser(
        "status", parents=[parent], help="backend, device readings, and what the current job waits for"
    ).set_defaults(func=status)

    srv = sub.add_parser(
        "serve",
        help="run the daemon in the foreground (needs `pip install 'lorad[server]'`)",
        add_help=False,
        description="All arguments are passed to the daemon; `lorad serve --help` shows its options.",
    )
    srv.add_argument("daemon_args", nargs=argparse.REMAINDER)
    srv.set_defaults(func=serve)

    prep = sub.add_parser(
        "prepare",
        help="build QNN NPU context bundles for a target SoC on a host (needs `pip install 'lorad[server]'`)",
        add_help=False,
        description="All arguments go to `lorad.server.engine.prepare`; `lorad prepare --help` shows its options.",
    )
    prep.add_argument("daemon_args", nargs=argparse.REMAINDER)
    prep.set_defaults(func=prepare)


def adapters_list(args: argparse.Namespace) -> int:
    """Lists adapters."""
    with make_client(args) as c:
        ads = c.list_adapters()
    if opt(args, "json"):
        print_json(ads)
    else:
        rows = [
            (
                a.adapter_id,
                a.job_id,
                a.base_model,
                a.lora.rank,
                a.steps,
                loss_change(a.eval_loss_before, a.eval_loss_after),
                human_bytes(a.size_bytes),
                when(a.created_at_ms),
            )
            for a in ads
        ]
        print_table(rows, ("ADAPTER", "JOB", "BASE", "RANK", "STEPS", "EVAL LOSS", "SIZE", "CREATED"))
    return EXIT_OK


def _loss(x: float) -> str:
    return "-" if math.isnan(x) or x <= 0 else f"{x:.3f}"


def loss_change(before: float, after: float) -> str:
    """ "2.340 -> 1.860"; a loss that was not measured (NaN or 0) shows as "-", both unmeasured as "-"."""
    b, a = _loss(before), _loss(after)
    return "-" if b == a == "-" else f"{b} -> {a}"


def adapters_show(args: argparse.Namespace) -> int:
    """Shows one adapter: a summary, and every layer's precision with --layers."""
    with make_client(args) as c:
        a = c.get_adapter(args.adapter_id)
    if opt(args, "json"):
        print_json(a)
        return EXIT_OK
    print(f"adapter  {a.adapter_id} (job {a.job_id})")
    print(f"base     {a.base_model} sha256 {a.base_model_sha256[:16]}…")
    print(f"lora     rank {a.lora.rank}, alpha {a.lora.alpha:g}, targets {','.join(a.lora.target_modules) or 'all'}")
    print(
        f"trained  {a.steps} steps on {a.sample_count} samples; held-out loss "
        f"{loss_change(a.eval_loss_before, a.eval_loss_after)}; train loss {_loss(a.train_loss)}"
    )
    plan = a.precision_plan
    if plan and args.layers:
        print_table([(p.layer, p.forward, p.backward) for p in plan], ("LAYER", "FORWARD", "BACKWARD"))
    elif plan:
        counts = collections.Counter(f"{_value(p.forward)}/{_value(p.backward)}" for p in plan)
        mix = ", ".join(f"{n} {k}" for k, n in counts.most_common())
        print(f"layers   {len(plan)} (forward/backward precision: {mix}); --layers lists each")
    return EXIT_OK


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


class _PullProgress:
    """A byte-count bar on a TTY, silence otherwise (pipes get the final line only)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.tty or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        frac = done / total if total else 1.0
        sys.stderr.write(f"\r\x1b[2K{bar(frac, 30)} {human_bytes(done)} / {human_bytes(total)}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def adapters_pull(args: argparse.Namespace) -> int:
    """Downloads an adapter."""
    with make_client(args) as c:
        r = c.download_adapter(
            args.adapter,
            args.output,
            args.format,
            overwrite=args.force,
            on_progress=None if opt(args, "json") else _PullProgress(),
        )
    if opt(args, "json"):
        print_json(r)
    else:
        resumed = f", resumed at {human_bytes(r.resumed_from)}" if r.resumed_from else ""
        print(f"{r.path}: {human_bytes(r.size_bytes)}, sha256 {r.sha256} verified{resumed}")
    return EXIT_OK


def adapters_delete(args: argparse.Namespace) -> int:
    """Deletes an adapter after a confirmation on a terminal (or with --yes)."""
    if not args.yes:
        if not sys.stdin.isatty():
            raise ValueError(f"not deleting {args.adapter_id} without confirmation: no terminal to ask on; pass --yes")
        answer = input(f"delete adapter {args.adapter_id} and its exports? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not deleted", file=sys.stderr)
            return EXIT_FAILURE
    with make_client(args) as c:
        freed = c.delete_adapter(args.adapter_id, cancel_dependents=args.cancel_dependents)
    if opt(args, "json"):
        print_json({"deleted": args.adapter_id, "freed_bytes": freed})
    else:
        print(f"deleted {args.adapter_id} ({human_bytes(freed)} freed)")
    return EXIT_OK


def generate(args: argparse.Namespace) -> int:
    """Streams generated text to stdout."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    kwargs = dict(
        adapter=args.adapter,
        extra_adapters=args.with_adapter,
        system=args.system,
        raw=args.raw,
        stop=args.stop,
        **sampling_kwargs(args),
    )
    with make_client(args) as c:
        if opt(args, "json"):
            chunks = list(c.generate(prompt, **kwargs))
            print_json(
                {
                    "text": "".join(x.text for x in chunks),
                    "token_count": chunks[-1].token_count if chunks else 0,
                    "prompt_token_count": chunks[0].prompt_token_count if chunks else 0,
                    "finish_reason": chunks[-1].finish_reason if chunks else None,
                }
            )
            return EXIT_OK
        for chunk in c.generate(prompt, **kwargs):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return EXIT_OK


def _count(n: int) -> str:
    """A parameter count the way model cards say it: 135M, 1.5B, 400K."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            v = n / div
            return f"{v:.1f}{unit}" if v < 10 and unit == "B" else f"{v:.0f}{unit}"
    return str(n)


def _yes_no(v: bool | None) -> str:
    return "unknown" if v is None else ("yes" if v else "no")


def print_status(s: DeviceStatus, job: Job | None = None) -> None:
    """The human form of `lorad status`; `job` is the app's current job, if any."""
    b, r = s.backend, s.readings
    soc = f" (SoC {b.soc_model}, HTP {b.htp_arch})" if b.soc_model else ""
    print(f"daemon    lorad {s.version}")
    print(f"backend   {b.backend.value}{soc}: {b.reason}")
    for av in b.available:
        print(f"          {av.backend.value}: {'usable' if av.usable else 'unusable'} {av.detail}".rstrip())
    k = b.cpu_kernels
    print(f"kernels   {k.detail or ('active' if k.active else 'inactive: torch ops run instead')}")
    temp = "unknown" if r.temperature_celsius is None else f"{r.temperature_celsius:.1f} °C"
    batt = "unknown" if r.battery_percent is None else f"{r.battery_percent}%"
    print(
        f"device    battery {batt}, charging {_yes_no(r.charging)}, temperature {temp}, idle {_yes_no(r.idle)} "
        f"(from {r.source or '?'})"
    )
    if s.profile.value != "unspecified":
        print(f"profile   {s.profile.value} ({s.profile_reason})")
    if s.can_train:
        print("training  allowed now")
    else:
        reasons = ", ".join(x.value.replace("_", " ") for x in s.blocked_reasons) or "unknown"
        print(f"training  blocked: {reasons}" + (f" ({s.blocked_detail})" if s.blocked_detail else ""))
        if s.unblock_hint:
            print(f"          to change it: {s.unblock_hint}")
    if job is not None:
        print(f"job       {job.job_id} {describe_wait(job)}  ({stats_text(job)})")
    elif s.current_job_id:
        print(f"job       {s.current_job_id} is {s.current_job_state.value}")
    for m in s.models:
        about = f"{m.family}, {_count(m.parameters)} params" if m.parameters else (m.detail or "not readable")
        print(f"model     {m.name} ({about}){' default' if m.is_default else ''}")


def status(args: argparse.Namespace) -> int:
    """Shows the device status."""
    with make_client(args) as c:
        s = c.device_status()
        job = c.get_job(s.current_job_id) if s.current_job_id else None
    from lorad.client.cli._federate import describe, joined

    if opt(args, "json"):
        print_json({**to_jsonable(s), "current_job": to_jsonable(job), "federation": joined()})
    else:
        print_status(s, job)
        for line in describe():
            print(line)
    return EXIT_OK


def serve(args: argparse.Namespace) -> int:
    """Runs the daemon (lorad.server.serve_main), imported only here so the SDK stays torch-free."""
    argv = list(args.daemon_args)
    if opt(args, "data_dir") and "--data-dir" not in argv:  # `lorad --data-dir X serve` means the same
        argv = ["--data-dir", str(opt(args, "data_dir")), *argv]
    return _run_server_command("serve_main", argv)


def prepare(args: argparse.Namespace) -> int:
    """Runs `lorad prepare` (the engine facade's prepare_main), imported only here."""
    return _run_server_command("prepare_main", list(args.daemon_args), module="lorad.server.engine.api")


def _run_server_command(entry: str, argv: list[str], module: str = "lorad.server") -> int:
    """Imports a daemon-side entry point lazily, with a clear error when the server extra is missing."""
    import importlib

    try:
        server = importlib.import_module(module)
        main = getattr(server, entry, None)  # the engine facade imports its entry point here, on first use
    except ImportError as exc:
        print(
            f"lorad: error: the daemon is not installed ({exc}). Install it with `pip install 'lorad[server]'` "
            "(or `make setup` in a clone), then run `lorad serve` again",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    if main is None:
        print(
            f"lorad: error: this {module} has no {entry} entry point (a daemon build without the server "
            "part); update lorad to a version whose daemon is complete",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    return int(main(argv) or 0)
