"""`lorad du` (disk use per app) and `lorad gc` (delete rebuildable exports and caches)."""

from __future__ import annotations

import argparse
from typing import Any

from lorad.client.cli._context import make_client, make_owner_client, opt
from lorad.client.cli._output import EXIT_OK, human_bytes, print_json, print_table
from lorad.client.sync_client import Client


def add_parsers(sub: Any, parent: argparse.ArgumentParser) -> None:
    """Registers `du` and `gc`."""
    du = sub.add_parser(
        "du", parents=[parent], help="disk use: data, checkpoints, adapters, exports (--all: every app and caches)"
    )
    du.add_argument("--all", action="store_true", help="every app plus the shared caches (device owner's token)")
    du.set_defaults(func=disk_usage)
    gc = sub.add_parser(
        "gc",
        parents=[parent],
        help="delete cached exports (and with --all the shared model caches); they are rebuilt when needed",
    )
    gc.add_argument("--all", action="store_true", help="every app's exports and the shared caches (owner's token)")
    gc.set_defaults(func=collect_garbage)


def _client(args: argparse.Namespace) -> Client:
    return make_owner_client(args) if args.all else make_client(args)


def disk_usage(args: argparse.Namespace) -> int:
    """Prints bytes per app and kind."""
    with _client(args) as c:
        u = c.disk_usage()
    if opt(args, "json"):
        print_json(u)
        return EXIT_OK
    rows = [
        (a.app_id, human_bytes(a.data_bytes), human_bytes(a.checkpoint_bytes), human_bytes(a.adapter_bytes),
         human_bytes(a.export_bytes), human_bytes(a.total_bytes))
        for a in u.apps
    ]  # fmt: skip
    print_table(rows, ("APP", "DATA", "CHECKPOINTS", "ADAPTERS", "EXPORTS", "TOTAL"))
    if args.all:
        print(f"shared caches {human_bytes(u.cache_bytes)}, database {human_bytes(u.database_bytes)}")
    cap = f"capped at {human_bytes(u.export_cache_limit_bytes)}" if u.export_cache_limit_bytes else "not capped"
    print(f"exports are rebuilt on demand ({cap}); `lorad gc` deletes them")
    return EXIT_OK


def collect_garbage(args: argparse.Namespace) -> int:
    """Deletes rebuildable files and says how much it freed."""
    with _client(args) as c:
        g = c.collect_garbage()
    if opt(args, "json"):
        print_json(g)
        return EXIT_OK
    print(f"freed {human_bytes(g.freed_bytes)} ({g.removed_files} files)")
    if g.caches_kept_reason:
        print(f"shared caches kept: {g.caches_kept_reason}")
    return EXIT_OK
