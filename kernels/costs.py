"""Measured cost model: milliseconds of one frozen product per (backend, shape, precision, direction) on this machine.

The planner prices precisions with this table instead of assuming that fewer bytes are faster (on x86 ORT w8a8 is no
faster than torch bf16, and fake-quant "w8a8" on torch is slower than fp32). A calibration times each distinct
weight shape per precision on random data and caches the result per machine, so it is paid once per host.

Two things keep the table steady enough to plan with. The precisions of one shape are timed in alternation (fp32,
bf16, w8a8, fp32, bf16, ...), so a host whose speed drifts while it measures shifts all of them alike and their
ratios, which is what a plan depends on, hold. And a table measured while something else had the cores is never
cached (the plan priced with it is cached as provisional, see ``precision.known_plan``): the calling thread's CPU
time over the timed calls, against their wall time, shows whether it had its core, since on a CPU backend it
computes or spin-waits through every call.
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

from lorad.kernels.capabilities import capability
from lorad.kernels.frozen import make_frozen_linear

log = structlog.get_logger(__name__)

COSTS_VERSION = 7  # 2: torch w8a8 a real int8 GEMM on CPUs with int8 dot products; 3: fastest of the repeats;
# 4: a shape's precisions timed in alternation, busy tables not cached; 5: fastest over PASSES passes; 6: ort-cpu
# w8a8 runs the uint8 x uint8 kernel on x86 without VNNI; 7: torch w8a8 quantizes and rescales in one fused pass each
PASSES = 3
"""Passes over all shapes; each entry keeps its fastest call over all of them. A fresh process's first second ran
int8 products up to 1.7x slower than later ones (bf16 1.1x), so one pass put SmolLM2's w8a8/bf16 ratios at 0.82-1.06
(lm_head) and 0.66-0.84 (down_proj) in four fresh processes, across the planner's 0.8 admission line, and fresh plans
took 26 or 44 int8 layers; three passes gave 0.69-0.74 and 0.63-0.71 (~2 s more, paid once per machine)."""
MIN_ROUND_MS = 40.0
"""A shape's timed rounds in one pass last at least this long: k/v's 0.2 ms products got 5 rounds (~6 ms) and their
w8a8/bf16 ratio spread 0.84-0.95 over fresh tables, against 0.70-0.80 for the 576x576 shape."""
_MAX_ROUNDS = 200  # per shape and pass, whatever MIN_ROUND_MS asks
BUSY_SHARE = 0.6
"""A table is "busy" when the thread timing the calls ran less than this share of their wall time (CPU backends;
quiet: 0.97-1.0 here, 0.4 with three other busy processes on the 2 cores)."""
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
    cpu_share: float = float("nan")
    """The timing thread's CPU time over wall time while this run measured (NaN: nothing timed, or an NPU backend)."""

    @property
    def busy(self) -> bool:
        """Measured while other work held the cores (see ``BUSY_SHARE``): fine for one plan, not to keep."""
        return busy(self.cpu_share)

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


def busy(cpu_share: float) -> bool:
    """Whether a timing thread that ran ``cpu_share`` of the wall time shared its core with other work (NaN: unknown,
    so not busy)."""
    return cpu_share < BUSY_SHARE


def _share_tells(backend: str) -> bool:
    """Whether the timing thread's CPU share tells a busy host: on a CPU backend (``Capability.runs_on_cpu``) the
    calling thread computes or spin-waits through every call; an NPU call makes it sleep, so there it says nothing."""
    return capability(backend).runs_on_cpu


def cpu_share_now(backend: str, seconds: float = 0.2) -> float:
    """The share of wall time a product loop on this thread gets right now (NaN where ``_share_tells`` says the
    share means nothing): whether a plan priced on a busy host can be re-planned on a quiet one (~0.2 s)."""
    if not _share_tells(backend):
        return float("nan")
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(256, 576, generator=g), torch.randn(576, 576, generator=g)
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    while time.perf_counter() - wall0 < seconds:
        torch.mm(a, w)
    return (time.thread_time() - cpu0) / (time.perf_counter() - wall0)


def _interleaved(
    calls: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]], repeats: int, min_ms: float = 0.0
) -> tuple[dict[str, float], float, float]:
    """(fastest ms per name, calling thread's CPU s, wall s) of at least ``repeats`` rounds over every call in turn,
    after one warm-up each; more rounds (up to ``_MAX_ROUNDS``) until the timed rounds took ``min_ms``.

    The fastest: other load only ever adds time. In turn: a drifting host slows every precision of the round alike.
    """
    for _, fn, a in calls:
        fn(a)  # warm-up: the first call may build a session or pack weights
    best = {name: float("inf") for name, _, _ in calls}
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    rounds = 0
    while rounds < repeats or (rounds < _MAX_ROUNDS and (time.perf_counter() - wall0) * 1e3 < min_ms):
        rounds += 1
        for name, fn, a in calls:
            t0 = time.perf_counter()
            fn(a)
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    return best, time.thread_time() - cpu0, time.perf_counter() - wall0


def measure(
    backend: str,
    shapes: Iterable[tuple[int, int]],
    precisions: Iterable[str],
    *,
    rows: int,
    cache_dir: Path | None = None,
    repeats: int = 5,
    on_progress: Callable[[float], None] | None = None,
) -> CostTable:
    """The cost table for every (shape, precision, direction), measuring only what the cache lacks.

    Args:
        backend: kernel backend to time.
        shapes: weight shapes (out, in).
        precisions: precisions to time (ones the backend rejects are skipped).
        rows: token rows per call the plan is for (the sequence bucket).
        cache_dir: where ``costs-<hash>.json`` lives (None: no cache).
        repeats: timed rounds over a shape's precisions per pass (the fastest call of each counts).
        on_progress: called with the fraction of entries done (0..1) as it goes.

    Every shape is timed in ``PASSES`` passes over all of them (``MIN_ROUND_MS`` a pass at least).
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
    cpu_s = wall_s = 0.0
    distinct = sorted(set(shapes))
    todo = {s: [p for p in precisions if not all(CostTable.key(s, p, d) in table.ms for d in ("fwd", "bwd"))]
            for s in distinct}  # fmt: skip
    work = [s for s in distinct if todo[s]]
    best: dict[str, float] = {}
    for n in range(PASSES):
        for i, shape in enumerate(work):
            if on_progress is not None:
                on_progress((n * len(work) + i) / (PASSES * len(work)))
            w = torch.randn(shape, generator=gen) * 0.02
            r = max(_MIN_ROWS, min(rows, _MAX_MACS // (shape[0] * shape[1])))
            x = torch.randn(r, shape[1], generator=gen)
            dy = torch.randn(r, shape[0], generator=gen)
            calls = []
            for p in todo[shape]:
                try:
                    fl = make_frozen_linear(w, None, backend=backend, precision=p, name=f"cost:{shape}")
                except ValueError:
                    continue
                calls += [
                    (CostTable.key(shape, p, "fwd"), fl.forward, x),
                    (CostTable.key(shape, p, "bwd"), fl.input_grad, dy),
                ]
            fastest, c, t = _interleaved(calls, repeats, MIN_ROUND_MS)
            for k, v in fastest.items():  # GEMM time is linear in rows (rows >= 32)
                best[k] = min(best.get(k, float("inf")), v * rows / r)
            cpu_s, wall_s = cpu_s + c, wall_s + t
    table.ms.update(best)
    added = len(best) // 2  # (shape, precision) pairs timed: a fwd and a bwd entry each
    if wall_s > 0 and _share_tells(backend):
        table.cpu_share = cpu_s / wall_s
    if table.busy:
        log.warning(
            "precision_costs_busy",
            backend=backend,
            cpu_share=round(table.cpu_share, 2),
            detail="other work held the cores while the costs were timed: used for this plan, not cached",
        )
    elif path is not None and added:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"machine": machine, "rows": rows, "ms": table.ms}, indent=1, sort_keys=True))
        tmp.replace(path)
    log.info("precision_costs_measured", backend=backend, rows=rows, measured=added, cached=len(table.ms) - 2 * added,
             cpu_share=round(table.cpu_share, 2))  # fmt: skip
    return table
