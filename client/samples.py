"""Reading samples from files and streams: plain text, or JSONL of {"text": ...} / {"messages": [...]} objects."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, TextIO

from lorad.client._requests import as_sample
from lorad.client.types import Sample, TextSample

Split = Literal["file", "paragraph", "line"]


class SampleFormatError(ValueError):
    """A line or file could not be read as samples; the message names the file, the line and the fix."""


def parse_jsonl(lines: Iterable[str], source: str) -> list[Sample]:
    """Parses JSONL: one JSON object per line, blank lines ignored.

    Raises:
        SampleFormatError: Naming `source:line` and what is wrong.
    """
    out: list[Sample] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SampleFormatError(f"{source}:{no}: not valid JSON ({exc.msg})") from None
        try:
            out.append(as_sample(obj))
        except (ValueError, TypeError) as exc:
            raise SampleFormatError(
                f'{source}:{no}: {exc}; expected {{"text": "..."}} or {{"messages": [{{"role": "user", ...}}]}}'
            ) from None
    return out


def split_text(text: str, split: Split) -> list[Sample]:
    """Turns plain text into samples: the whole text, each blank-line-separated paragraph, or each line."""
    if split == "file":
        parts = [text.strip()]
    elif split == "paragraph":
        parts = [p.strip() for p in re.split(r"\n\s*\n", text)]
    else:
        parts = [p.strip() for p in text.splitlines()]
    return [TextSample(p) for p in parts if p]


def _looks_like_jsonl(text: str) -> bool:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return bool(lines) and all(ln.lstrip().startswith("{") for ln in lines)


def read_samples(path: Path, split: Split = "file", fmt: str = "auto") -> list[Sample]:
    """Reads one file: `.jsonl` (or fmt="jsonl") as JSONL, anything else as UTF-8 text split by `split`.

    Raises:
        SampleFormatError: The file is not UTF-8 or a JSONL line is invalid.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SampleFormatError(f"{path}: not UTF-8 text; convert it (e.g. iconv -t UTF-8) first") from None
    if fmt == "jsonl" or (fmt == "auto" and path.suffix.lower() in (".jsonl", ".ndjson")):
        return parse_jsonl(text.splitlines(), str(path))
    return split_text(text, split)


def read_stream(stream: TextIO, split: Split = "file", fmt: str = "auto", name: str = "<stdin>") -> list[Sample]:
    """Reads samples from a text stream; with fmt="auto", JSONL when every non-blank line starts with "{"."""
    text = stream.read()
    if fmt == "jsonl" or (fmt == "auto" and _looks_like_jsonl(text)):
        return parse_jsonl(text.splitlines(), name)
    return split_text(text, split)
