"""Measured cost model: milliseconds of one frozen product per (backend, shape, precision, direction) on this machine.

The planner prices precisions with this table instead of assuming that fewer bytes are faster (on x86 ORT w8a8 is no
faster than torch bf16, and fake-quant "w8a8" on torch is slower than fp32). A calibration times each distinct
weight shape once per precision on random data and caches the result per machine, so it is paid once per host.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from lorad.kernels.frozen import make_frozen_linear

log = structlog.get_logger(__name__)

COSTS_VERSION = 3  # 2: torch w8a8 a real int8 GEMM on CPUs with int8 dot products; 3: fastest of the repeats
# Rows timed per call are capped so one product does at most this many multiply-adds (the 49152x576 lm_head at 256
# rows would take ~1 s in torch fp32 here); the time is scaled linearly to the requested rows (GEMM time is linear in
# rows once rows >= 32).
_MAX_MACS = 40_000_000
_MIN_ROWS = 32


@dataclass
class CostTable:
    """Measured ms per call at ``rows`` rows, keyed ``"<out>x<in>|<precision>|<fwd|bwd>"``."""

    backend: str
    rows: int
    machine: str
    ms: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def key(shape: tuple[int, int], precision: str, direction: str) -> str:
        """The table key of one product."""
        return f"{shape[0]}x{shape[1]}|{precision}|{direction}"

    def get(self, shape: tuple[int, int], precision: str, direction: str) -> float:
        """ms of one call (KeyError when not measured)."""
        return self.ms[self.key(shape, precision, direction)]


def machine_fingerprint(backend: str) -> str:
    """What decides the timings: CPU model, core count, thread setting, library versions and the backend."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [backend, cpu, str(os.cpu_count()), str(torch.get_num_threads()), torch.__version__]
    if backend != "torch":
        import onnxruntime as ort

        parts.append(ort.__version__)
    return " / ".join(parts)


def _time_call(fn: Callable[[torch.Tensor], torch.Tensor], a: torch.Tensor, repeats: int) -> float:
    fn(a)  # warm-up: the first call may build a session or pack weights
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(a)
        times.append(time.perf_counter() - t0)
    # The fastest call: other load on the machine only ever adds time, and the table is kept for the machine.
    return min(times) * 1e3


def measure(
    backend: str,
    shapes: Iterable[tuple[int, int]],
    precisions: Iterable[str],
    *,
    rows: int,
    cache_dir: Path | None = None,
    repeats: int = 3,
    on_progress: Callable[[float], None] | None = None,
) -> CostTable:
    """The cost table for every (shape, precision, direction), measuring only what the cache lacks.

    Args:
        backend: kernel backend to time.
        shapes: weight shapes (out, in).
        precisions: precisions to time (ones the backend rejects are skipped).
        rows: token rows per call the plan is for (the sequence bucket).
        cache_dir: where ``costs-<hash>.json`` lives (None: no cache).
        repeats: timed calls per entry (the fastest counts).
        on_progress: called with the fraction of entries done (0..1) as it goes.
    """
    machine = machine_fingerprint(backend)
    table = CostTable(backend, rows, machine)
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(f"{COSTS_VERSION}|{machine}|{rows}".encode()).hexdigest()[:16]
        path = Path(cache_dir) / f"costs-{digest}.json"
        try:
            doc = json.loads(path.read_text())
            if doc.get("machine") == machine and doc.get("rows") == rows:
                table.ms.update({str(k): float(v) for k, v in doc["ms"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    gen = torch.Generator().manual_seed(0)
    added = 0
    todo = [(shape, p) for shape in sorted(set(shapes)) for p in precisions]
    for i, (shape, p) in enumerate(todo):
        if on_progress is not None:
            on_progress(i / len(todo))
        if all(CostTable.key(shape, p, d) in table.ms for d in ("fwd", "bwd")):
            continue
        w = torch.randn(shape, generator=gen) * 0.02
        try:
            fl = make_frozen_linear(w, None, backend=backend, precision=p, name=f"cost:{shape}")
        except ValueError:
            continue
        r = max(_MIN_ROWS, min(rows, _MAX_MACS // (shape[0] * shape[1])))
        x = torch.randn(r, shape[1], generator=gen)
        dy = torch.randn(r, shape[0], generator=gen)
        scale = rows / r
        table.ms[CostTable.key(shape, p, "fwd")] = _time_call(fl.forward, x, repeats) * scale
        table.ms[CostTable.key(shape, p, "bwd")] = _time_call(fl.input_grad, dy, repeats) * scale
        added += 1
    if path is not None and added:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"machine": machine, "rows": rows, "ms": table.ms}, indent=1, sort_keys=True))
        tmp.replace(path)
    log.info("precision_costs_measured", backend=backend, rows=rows, measured=added, cached=len(table.ms) - 2 * added)
    return table
