"""The `lorad` command line, built on the SDK (entry point `lorad.client.cli:main`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from collections.abc import Sequence

from lorad import __version__
from lorad.client.cli import _apps_data, _chat, _disk, _federate, _jobs, _misc
from lorad.client.cli._context import global_options, opt
from lorad.client.cli._output import (
    EXIT_CODES_HELP,
    EXIT_OK,
    EXIT_USAGE,
    print_json,
    report_error,
)
from lorad.client.errors import InvalidArgument, LoradError

DESCRIPTION = """\
lorad personalizes a small language model on this device: apps submit their user's notes and chats, a
nightly job trains a LoRA adapter while the phone charges (on the NPU where there is one), and apps
download the adapter or generate with it.

typical session:
  lorad serve &                                   # the daemon (or its system service)
  lorad app register notes --save                 # device owner: a token for the app
  lorad data add diary notes.jsonl                # the app's samples
  lorad train diary --nightly "30 2 * * *"        # or now: lorad train diary --watch
  lorad adapters pull job_... -o adapter.tar      # sha256-verified, resumable
  lorad generate "What is my dog called?" --adapter job_...
  lorad chat --adapter job_...                    # one message per line; Ctrl-D ends
"""

EPILOG = (
    EXIT_CODES_HELP
    + """
configuration (first match wins): daemon --target, else --data-dir's socket, else LORAD_TARGET, else
~/.config/lorad/client.toml (target, data_dir), else <data_dir>/run/lorad.sock (LORAD_STORAGE_DATA_DIR);
token --token, else LORAD_TOKEN (app) / LORAD_OWNER_TOKEN or <data_dir>/owner.token (owner), else
client.toml's token when it names no target or the same daemon. Details: client/README_CLI.md.
"""
)


def build_parser() -> argparse.ArgumentParser:
    """The whole `lorad` argument parser."""
    parent = global_options()
    parser = argparse.ArgumentParser(
        prog="lorad",
        description=DESCRIPTION,
        epilog=EPILOG,
        parents=[parent],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lorad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _apps_data.add_parsers(sub, parent)
    _jobs.add_parsers(sub, parent)
    _misc.add_parsers(sub, parent)
    _chat.add_parsers(sub, parent)
    _disk.add_parsers(sub, parent)
    _federate.add_parsers(sub, parent)
    return parser


# Commands whose arguments all belong to a daemon-side parser (argparse.REMAINDER cannot take a leading `--x`).
_PASSTHROUGH = frozenset({"serve", "prepare"})
_GLOBAL_VALUE_OPTIONS = frozenset({"--target", "--token", "--data-dir", "--timeout"})


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits `lorad [global options] serve|prepare ARGS...` into the CLI's part and the passed-through ARGS."""
    for i, token in enumerate(argv):
        if token in _PASSTHROUGH and (i == 0 or argv[i - 1] not in _GLOBAL_VALUE_OPTIONS):
            return argv[: i + 1], argv[i + 1 :]
    return argv, []


_TOKEN_SHAPE = re.compile(r"-[A-Za-z0-9_-]{42}")  # a daemon token (43 URL-safe characters) that begins with "-"


def _glue_token_values(argv: list[str]) -> list[str]:
    """``--token -x…`` as ``--token=-x…``: argparse reads a value that begins with "-" as an option, and tokens issued
    before lorad stopped issuing them can begin with one."""
    out: list[str] = []
    for a in argv:
        if out and out[-1] == "--token" and _TOKEN_SHAPE.fullmatch(a):
            out[-1] = f"--token={a}"
        else:
            out.append(a)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one `lorad` command and returns its exit code (see `lorad --help`)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    head, passthrough = _split_passthrough(args_list)
    head = _glue_token_values(head)
    parser = build_parser()
    wants_json = "--json" in head
    usage = io.StringIO()
    try:
        # Under --json a usage error is JSON too: argparse's text is captured and wrapped.
        with contextlib.redirect_stderr(usage) if wants_json else contextlib.nullcontext():
            args = parser.parse_args(head)
        if passthrough:
            args.daemon_args = passthrough
    except SystemExit as exc:  # argparse exits 2 on usage errors and 0 for --help
        code = int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
        text = usage.getvalue().strip()
        if wants_json and code == EXIT_USAGE:
            message = re.sub(r"^lorad[\w -]*: error: ", "", text.splitlines()[-1]) if text else "usage error"
            print_json({"error": {"code": "USAGE", "type": "UsageError", "message": message, "field": ""}}, sys.stderr)
        elif text:
            print(text, file=sys.stderr)
        return code
    as_json = bool(opt(args, "json", False))
    try:
        return int(args.func(args))
    except LoradError as err:
        return report_error(err, as_json)
    except ValueError as err:  # bad option values the SDK or CLI rejected before any call
        return report_error(InvalidArgument(str(err), code="INVALID_ARGUMENT"), as_json)
    except KeyboardInterrupt:
        print("lorad: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except OSError as err:
        return report_error(LoradError(f"{err.strerror or err}: {err.filename or ''}".rstrip(": ")), as_json)


if __name__ == "__main__":
    sys.exit(main())
