"""CLI output: JSON for scripts, aligned tables and short summaries for people, and error reporting."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from lorad.client.errors import LoradError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INVALID = 4
EXIT_AUTH = 5
EXIT_UNAVAILABLE = 6
EXIT_STATE = 7
EXIT_EXHAUSTED = 8

EXIT_CODES_HELP = """\
exit codes:
  0  success
  1  failure (a job failed, a download did not verify, an internal error)
  2  usage error (bad command line)
  3  not found (no such app, dataset, job or adapter)
  4  invalid argument (the message names the field)
  5  unauthenticated or permission denied (missing/invalid token: see --token, LORAD_TOKEN)
  6  daemon unavailable (not running, wrong socket) or deadline exceeded
  7  failed precondition: illegal in the current state, already exists, job cancelled
  8  resource exhausted (quota or disk full)
"""


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, enums, tuples and paths as plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, list | tuple):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def print_json(obj: Any, stream: TextIO | None = None) -> None:
    """One JSON document on one line."""
    print(json.dumps(to_jsonable(obj), ensure_ascii=False), file=stream or sys.stdout, flush=True)


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str], stream: TextIO | None = None) -> None:
    """A left-aligned text table; "(none)" when empty."""
    out = stream or sys.stdout
    if not rows:
        print("(none)", file=out)
        return
    cells = [[str(c) for c in header], *[[_cell(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)


def _cell(c: Any) -> str:
    if isinstance(c, enum.Enum):
        return str(c.value)
    if isinstance(c, float):
        return f"{c:.4g}"
    return "-" if c is None or c == "" else str(c)


def when(ms: int) -> str:
    """Unix ms as local "YYYY-MM-DD HH:MM", or "-" for 0."""
    if not ms:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M")


def human_bytes(n: int) -> str:
    """Bytes with a binary unit, e.g. 1.5 MiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def report_error(err: LoradError, as_json: bool) -> int:
    """Prints the error to stderr (JSON with code/field in --json mode) and returns its exit code."""
    if as_json:
        print_json(
            {"error": {"code": err.code, "type": type(err).__name__, "message": err.message, "field": err.field}},
            sys.stderr,
        )
    else:
        field = f" (field: {err.field})" if err.field else ""
        print(f"lorad: error: {err.message}{field}", file=sys.stderr)
    return err.exit_code
