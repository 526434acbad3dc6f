"""Shared CLI plumbing: global options, and building SDK clients from them."""

from __future__ import annotations

import argparse
import os
from typing import Any

from lorad.client import config as cfg
from lorad.client.errors import ConfigurationError
from lorad.client.sync_client import Client


def global_options() -> argparse.ArgumentParser:
    """Options accepted before or after any subcommand (SUPPRESS keeps a later position from resetting them)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection and output")
    g.add_argument("--target", default=argparse.SUPPRESS, help="daemon socket path or host:port (env LORAD_TARGET)")
    g.add_argument("--token", default=argparse.SUPPRESS, help="app token (env LORAD_TOKEN, or client.toml)")
    g.add_argument(
        "--data-dir",
        default=argparse.SUPPRESS,
        help="the daemon's data directory: finds its socket and owner.token (env LORAD_STORAGE_DATA_DIR)",
    )
    g.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help="per-call deadline, seconds (30)")
    g.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable JSON output")
    return p


def opt(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    """A global option's value, or `default` when it was not given."""
    return getattr(args, name, default)


def make_client(args: argparse.Namespace) -> Client:
    """A Client for app calls; fails early, naming every place a token can come from, when there is none."""
    client = Client(
        opt(args, "target"), opt(args, "token"), timeout=opt(args, "timeout"), data_dir=opt(args, "data_dir")
    )
    if opt(args, "token"):
        client.token_source = "--token"
    if client.settings.token is None:
        client.close()
        raise ConfigurationError(
            f'no app token: pass --token, set {cfg.ENV_TOKEN}, or put token = "..." in {cfg.config_file_path()} '
            "(the device owner creates one with `lorad app register <app-id> --save`)"
        )
    return client


def make_owner_client(args: argparse.Namespace) -> Client:
    """A Client holding the owner token: --token, else $LORAD_OWNER_TOKEN, else <data_dir>/owner.token."""
    token, source = (opt(args, "token"), "--token") if opt(args, "token") else cfg.owner_token(opt(args, "data_dir"))
    client = Client(opt(args, "target"), token, timeout=opt(args, "timeout"), data_dir=opt(args, "data_dir"))
    client.token_source = source
    return client


def data_dir_arg(args: argparse.Namespace) -> str | os.PathLike[str] | None:
    """The --data-dir option, if given."""
    value: str | os.PathLike[str] | None = opt(args, "data_dir")
    return value
