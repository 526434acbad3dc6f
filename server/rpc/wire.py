"""Finds which field of an undecodable request is not UTF-8, so INVALID_ARGUMENT can name it.

protobuf refuses to parse a message whose string field holds invalid UTF-8, and gRPC would answer INTERNAL
without saying where. The interceptor decodes leniently; on failure this walks the wire format with the message
descriptor and returns the path of the first bad string (e.g. ``samples[2].chat.messages[0].content``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request that failed to parse."""

    raw: bytes
    descriptor: Descriptor


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        result |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return result, i
        shift += 7


def bad_utf8_path(buf: bytes, desc: Descriptor, prefix: str = "") -> str | None:
    """The path of the first string field that is not valid UTF-8, or None (also for malformed input)."""
    counts: dict[int, int] = {}
    i = 0
    try:
        while i < len(buf):
            key, i = _varint(buf, i)
            num, wire = key >> 3, key & 7
            if wire == 0:
                _, i = _varint(buf, i)
                continue
            if wire == 1:
                i += 8
                continue
            if wire == 5:
                i += 4
                continue
            if wire != 2:
                return None
            n, i = _varint(buf, i)
            chunk, i = buf[i : i + n], i + n
            f = desc.fields_by_number.get(num)
            if f is None:
                continue
            idx = counts.get(num, 0)
            counts[num] = idx + 1
            repeated = bool(getattr(f, "is_repeated", False))
            path = f"{prefix}{f.name}" + (f"[{idx}]" if repeated else "")
            if f.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                found = bad_utf8_path(chunk, f.message_type, path + ".") if f.message_type else None
                if found:
                    return found
    except ValueError:
        return None
    return None


@dataclass(frozen=True)
class TooMany:
    """Stands in for a request with more than ``limit`` entries of a repeated field (counted before parsing)."""

    field: str
    limit: int


# Repeated fields bounded before the message is parsed: parsing 10^6 tiny samples alone costs ~100 MiB.
REPEATED_LIMITS = {"samples": 1000}


def count_exceeds(buf: bytes, number: int, limit: int) -> bool:
    """True if top-level field ``number`` occurs more than ``limit`` times (stops counting there)."""
    seen = i = 0
    try:
        while i < len(buf):
            key, i = _varint(buf, i)
            wire = key & 7
            if wire == 0:
                _, i = _varint(buf, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                n, i = _varint(buf, i)
                i += n
            else:
                return False
            if key >> 3 == number:
                seen += 1
                if seen > limit:
                    return True
    except ValueError:
        return False
    return False


def lenient(deserializer: Any, desc: Descriptor | None) -> Any:
    """Wraps a request deserializer: a parse failure yields an Undecodable instead of an INTERNAL error."""
    if deserializer is None or desc is None:
        return deserializer
    bounded = [(f.number, f.name, REPEATED_LIMITS[f.name]) for f in desc.fields if f.name in REPEATED_LIMITS]

    def parse(raw: bytes) -> Any:
        for number, name, limit in bounded:
            if count_exceeds(raw, number, limit):
                return TooMany(name, limit)
        try:
            return deserializer(raw)
        except Exception:
            return Undecodable(raw, desc)

    return parse
