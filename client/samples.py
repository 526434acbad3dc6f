"""Reading samples from files and streams: plain text, JSONL, or JSON (an array of samples or one sample object)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, TextIO

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


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _sample_at(obj: Any, where: str) -> Sample:
    try:
        return as_sample(obj)
    except (ValueError, TypeError) as exc:
        raise SampleFormatError(
            f'{where}: {exc}; expected {{"text": "..."}} or {{"messages": [{{"role": "user", ...}}]}}'
        ) from None


def parse_json(text: str, source: str) -> list[Sample]:
    """Parses a JSON document: an array of sample objects (or strings), or one sample object.

    Raises:
        SampleFormatError: Naming `source:line` (the line where the bad element starts) and what is wrong.
    """
    dec = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    try:
        if not text.startswith("[", pos):
            obj, end = dec.raw_decode(text, pos)
            if _skip_ws(text, end) != len(text):
                raise SampleFormatError(f"{source}:{_line(text, end)}: extra data after the JSON value")
            if not isinstance(obj, dict):
                raise SampleFormatError(f"{source}:{_line(text, pos)}: expected an array of samples or one object")
            return [_sample_at(obj, f"{source}:{_line(text, pos)}")]
        out: list[Sample] = []
        pos = _skip_ws(text, pos + 1)
        if text.startswith("]", pos):
            return out
        while True:
            obj, end = dec.raw_decode(text, pos)
            out.append(_sample_at(obj, f"{source}:{_line(text, pos)}"))
            pos = _skip_ws(text, end)
            if text.startswith("]", pos):
                break
            if not text.startswith(",", pos):
                raise SampleFormatError(f"{source}:{_line(text, pos)}: expected ',' or ']' in the array")
            pos = _skip_ws(text, pos + 1)
        if _skip_ws(text, pos + 1) != len(text):
            raise SampleFormatError(f"{source}:{_line(text, pos + 1)}: extra data after the JSON array")
        return out
    except json.JSONDecodeError as exc:
        raise SampleFormatError(f"{source}:{exc.lineno}: not valid JSON ({exc.msg})") from None


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


def _looks_like_json(text: str) -> bool:
    head = text.lstrip()
    if head.startswith("["):
        return True
    if not head.startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _parse(text: str, split: Split, fmt: str, source: str) -> list[Sample]:
    if fmt == "jsonl":
        return parse_jsonl(text.splitlines(), source)
    if fmt == "json":
        return parse_json(text, source)
    return split_text(text, split)


def read_samples(path: Path, split: Split = "file", fmt: str = "auto") -> list[Sample]:
    """Reads one file: `.jsonl`/`.ndjson` as JSONL, `.json` as JSON, anything else as UTF-8 text split by `split`.

    A UTF-8 byte-order mark at the start is ignored.

    Raises:
        SampleFormatError: The file is not UTF-8 or a JSON(L) sample is invalid (names file:line).
    """
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise SampleFormatError(f"{path}: not UTF-8 text; convert it (e.g. iconv -t UTF-8) first") from None
    if fmt == "auto":
        suffix = path.suffix.lower()
        fmt = "jsonl" if suffix in (".jsonl", ".ndjson") else "json" if suffix == ".json" else "text"
    return _parse(text, split, fmt, str(path))


def read_stream(stream: TextIO, split: Split = "file", fmt: str = "auto", name: str = "<stdin>") -> list[Sample]:
    """Reads samples from a text stream; with fmt="auto", JSONL when every non-blank line starts with "{", JSON
    when the text is one array or one object, else text. A leading byte-order mark is ignored."""
    text = stream.read().removeprefix("\ufeff")
    if fmt == "auto":
        fmt = "jsonl" if _looks_like_jsonl(text) else "json" if _looks_like_json(text) else "text"
    return _parse(text, split, fmt, name)
