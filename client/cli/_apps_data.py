"""`lorad app ...` (device owner) and `lorad data ...` commands."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from lorad.client import config as cfg
from lorad.client.cli._context import make_client, make_owner_client, opt
from lorad.client.cli._output import EXIT_OK, human_bytes, print_json, print_table, report_error, when
from lorad.client.errors import InvalidArgument
from lorad.client.samples import SampleFormatError, read_samples, read_stream
from lorad.client.types import AppQuota, Sample


def add_parsers(sub: Any, parent: argparse.ArgumentParser) -> None:
    """Registers `app` and `data`."""
    app = sub.add_parser("app", parents=[parent], help="register, list and revoke apps (device owner)")
    app_sub = app.add_subparsers(dest="action", required=True, metavar="{register,list,revoke,rotate,forget}")
    reg = app_sub.add_parser(
        "register",
        parents=[parent],
        help="register an app and print its token (shown once)",
        description="Uses the owner token: --token, LORAD_OWNER_TOKEN, or <data-dir>/owner.token.",
    )
    reg.add_argument("app_id", help="id like 'notes': [a-z0-9][a-z0-9._-]{0,63}")
    reg.add_argument("--name", default="", help="display name (default: the id)")
    reg.add_argument("--max-samples", type=int, default=0, help="quota: stored samples (0 = daemon default)")
    reg.add_argument("--max-bytes", type=int, default=0, help="quota: stored sample bytes (0 = default)")
    reg.add_argument("--max-adapters", type=int, default=0, help="quota: adapters kept (0 = default)")
    reg.add_argument(
        "--save", action="store_true", help=f"write the token (and --target) into {cfg.config_file_path()}"
    )
    reg.set_defaults(func=app_register)
    app_sub.add_parser("list", parents=[parent], help="list registered apps").set_defaults(func=app_list)
    rev = app_sub.add_parser("revoke", parents=[parent], help="revoke an app's token at once (data stays)")
    rev.add_argument("app_id")
    rev.set_defaults(func=app_revoke)
    rot = app_sub.add_parser("rotate", parents=[parent], help="issue a new token for an app (the old one stops)")
    rot.add_argument("app_id")
    rot.add_argument("--save", action="store_true", help=f"write the new token into {cfg.config_file_path()}")
    rot.set_defaults(func=app_rotate)
    fgt = app_sub.add_parser("forget", parents=[parent], help="delete all of an app's data, jobs and adapters")
    fgt.add_argument("app_id")
    fgt.set_defaults(func=app_forget)

    data = sub.add_parser("data", parents=[parent], help="add, list and delete an app's training data")
    data_sub = data.add_subparsers(dest="action", required=True, metavar="{add,list,delete}")
    add = data_sub.add_parser(
        "add",
        parents=[parent],
        help="append samples from files or stdin",
        description='Files ending in .jsonl hold one JSON object per line: {"text": ...} or '
        '{"messages": [{"role": "user"|"assistant"|"system", "content": ...}]}; .json files hold an array of '
        "such objects or one object. Other files are UTF-8 text (see --split); a byte-order mark is ignored. "
        "With no files or '-', stdin is read (JSONL when every line starts with '{', JSON for one array/object).",
    )
    add.add_argument("dataset", help="dataset id (created on first add)")
    add.add_argument("files", nargs="*", type=Path, help="input files; '-' or none reads stdin")
    add.add_argument(
        "--split",
        choices=("file", "paragraph", "line"),
        default="file",
        help="plain text: one sample per file (default), per blank-line paragraph, or per line",
    )
    add.add_argument(
        "--format",
        dest="fmt",
        choices=("auto", "text", "jsonl", "json"),
        default="auto",
        help="input format (auto: by extension, stdin by content)",
    )
    add.set_defaults(func=data_add)
    data_sub.add_parser("list", parents=[parent], help="list datasets").set_defaults(func=data_list)
    dele = data_sub.add_parser("delete", parents=[parent], help="delete a dataset and its samples")
    dele.add_argument("dataset")
    dele.add_argument(
        "--cancel-dependents",
        action="store_true",
        help="also cancel unfinished jobs and delete schedules that read the dataset",
    )
    dele.add_argument(
        "--with-adapters",
        action="store_true",
        help="also delete the adapters that learned from it (trained on it, or trained on from such an adapter)",
    )
    dele.set_defaults(func=data_delete)


def app_register(args: argparse.Namespace) -> int:
    """Registers an app; prints its token."""
    quota = AppQuota(args.max_samples, args.max_bytes, args.max_adapters, 0)
    with make_owner_client(args) as c:
        reg = c.register_app(args.app_id, args.name, quota)
        target = c.settings.target
    saved = cfg.save_token(reg.token, target=opt(args, "target") or target) if args.save else None
    if opt(args, "json"):
        print_json({"app": reg.app, "token": reg.token, "saved_to": str(saved) if saved else None})
        return EXIT_OK
    print(f"registered app {reg.app.app_id!r}")
    print(f"token: {reg.token}")
    if saved:
        print(f"saved to {saved} (mode 0600): the CLI and SDK on this account now use it")
    else:
        print("the token is shown only once: store it, or re-run with --save to keep it in client.toml")
    return EXIT_OK


def app_list(args: argparse.Namespace) -> int:
    """Lists apps."""
    with make_owner_client(args) as c:
        apps = c.list_apps()
    if opt(args, "json"):
        print_json(apps)
    else:
        rows = [
            (
                a.app_id,
                a.display_name,
                "revoked" if a.revoked else "active",
                a.sample_count,
                human_bytes(a.sample_bytes),
                when(a.created_at_ms),
            )
            for a in apps
        ]
        print_table(rows, ("APP", "NAME", "STATUS", "SAMPLES", "BYTES", "REGISTERED"))
    return EXIT_OK


def app_revoke(args: argparse.Namespace) -> int:
    """Revokes an app."""
    with make_owner_client(args) as c:
        c.revoke_app(args.app_id)
    if opt(args, "json"):
        print_json({"revoked": args.app_id})
    else:
        print(f"revoked {args.app_id!r}: its token no longer works (data stays until `lorad app forget`)")
    return EXIT_OK


def app_rotate(args: argparse.Namespace) -> int:
    """Rotates an app's token; prints the new one."""
    with make_owner_client(args) as c:
        token = c.rotate_app_token(args.app_id)
        target = c.settings.target
    saved = cfg.save_token(token, target=opt(args, "target") or target) if args.save else None
    if opt(args, "json"):
        print_json({"app_id": args.app_id, "token": token, "saved_to": str(saved) if saved else None})
        return EXIT_OK
    print(f"new token for {args.app_id!r} (the old one no longer works): {token}")
    if saved:
        print(f"saved to {saved} (mode 0600)")
    return EXIT_OK


def app_forget(args: argparse.Namespace) -> int:
    """Forgets an app."""
    with make_owner_client(args) as c:
        r = c.forget_app(args.app_id)
    if opt(args, "json"):
        print_json(r)
    else:
        print(
            f"forgot {args.app_id!r}: {r.deleted_samples} samples, {r.deleted_adapters} adapters, "
            f"{r.deleted_jobs} jobs, {human_bytes(r.freed_bytes)} freed"
        )
    return EXIT_OK


def _gather(args: argparse.Namespace) -> list[Sample]:
    samples: list[Sample] = []
    files = args.files or [Path("-")]
    for f in files:
        if str(f) == "-":
            samples += read_stream(sys.stdin, args.split, args.fmt)
        elif not f.is_file():
            raise SampleFormatError(f"{f}: no such file")
        else:
            samples += read_samples(f, args.split, args.fmt)
    return samples


def data_add(args: argparse.Namespace) -> int:
    """Appends samples."""
    try:
        samples = _gather(args)
    except SampleFormatError as exc:
        return report_error(InvalidArgument(str(exc), code="INVALID_ARGUMENT"), bool(opt(args, "json")))
    if not samples:
        msg = "no samples found in the input (empty files?)"
        return report_error(InvalidArgument(msg, code="INVALID_ARGUMENT"), bool(opt(args, "json")))
    with make_client(args) as c:
        r = c.append_samples(args.dataset, samples)
    if opt(args, "json"):
        print_json(r)
    else:
        total = r.dataset.sample_count if r.dataset else "?"
        print(f"{args.dataset}: {r.accepted_count} added, {r.duplicate_count} already present, {total} in total")
    return EXIT_OK


def data_list(args: argparse.Namespace) -> int:
    """Lists datasets."""
    with make_client(args) as c:
        ds = c.list_datasets()
    if opt(args, "json"):
        print_json(ds)
    else:
        rows = [(d.dataset_id, d.sample_count, human_bytes(d.size_bytes), when(d.updated_at_ms)) for d in ds]
        print_table(rows, ("DATASET", "SAMPLES", "BYTES", "UPDATED"))
    return EXIT_OK


def data_delete(args: argparse.Namespace) -> int:
    """Deletes a dataset."""
    with make_client(args) as c:
        r = c.delete_dataset(args.dataset, cancel_dependents=args.cancel_dependents, delete_adapters=args.with_adapters)
    if opt(args, "json"):
        print_json({"dataset_id": args.dataset, **dataclasses.asdict(r)})
    else:
        adapters = f", {r.deleted_adapters} adapters" if args.with_adapters else ""
        print(f"deleted {args.dataset!r} ({r.deleted_samples} samples{adapters})")
    return EXIT_OK
