"""Communication ledger: payload bytes sent to and received from each device in each round, as JSON lines."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flwr.app import ArrayRecord, RecordDict


def payload_bytes(content: RecordDict) -> int:
    """Serialized bytes of a message's arrays (numpy buffers with their headers); config and metrics are tiny."""
    return sum(len(arr.data) for rec in content.array_records.values() for arr in rec.values())


def arrays_bytes(record: ArrayRecord) -> int:
    """Serialized bytes of one ArrayRecord."""
    return sum(len(arr.data) for arr in record.values())


@dataclass(frozen=True)
class Entry:
    """One device's traffic in one round; ``status`` is sent, accepted, declined, rejected or failed."""

    round: int
    node_id: int
    direction: str  # "down" (server -> device) or "up" (device -> server)
    bytes: int
    status: str
    reason: str = ""  # a code (e.g. "not_charging", "rank"), never sample content
    time_s: float = 0.0


class Ledger:
    """Appends entries in memory and, when ``path`` is set, to a JSONL file (one line per entry, flushed)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.entries: list[Entry] = []
        self._lock = threading.Lock()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, round_: int, node_id: int, direction: str, nbytes: int, status: str, *, reason: str = "") -> None:
        """Records one entry."""
        e = Entry(round_, node_id, direction, nbytes, status, reason, round(time.time(), 3))
        with self._lock:
            self.entries.append(e)
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(json.dumps(asdict(e)) + "\n")

    def round_summary(self, round_: int) -> dict[str, int]:
        """Bytes down/up and device counts by status for one round."""
        es = [e for e in self.entries if e.round == round_]
        out = {
            "bytes_down": sum(e.bytes for e in es if e.direction == "down"),
            "bytes_up": sum(e.bytes for e in es if e.direction == "up"),
        }
        for e in es:
            if e.direction == "up":
                out[e.status] = out.get(e.status, 0) + 1
        return out


def read_ledger(path: Path) -> list[Entry]:
    """Entries of a ledger file."""
    return [Entry(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
