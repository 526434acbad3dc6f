"""The one table of what each backend can run: precisions per direction, dtypes, shapes, where it runs, what plans.

Everything that needs a backend fact reads it here: the backends' own precision checks, CreateJob validation, the
precision planner's menu, ``lorad status`` and the docs (a test renders the README table from it).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

# Every precision name lorad knows, in the order menus are shown. "bf16" keeps one bfloat16 copy of W and
# accumulates in fp32 (oneDNN on x86 with AVX512-BF16/AMX, ARM cores with BF16); the w* names are integer weight
# grids with per-channel scales and per-row activation scales.
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "w8a16", "w8a8", "w4a16")


@dataclass(frozen=True)
class Capability:
    """What one backend runs.

    Attributes:
        name: backend name (``torch``, ``ort-cpu``, ``qnn-htp``).
        precisions: precisions accepted for the forward and for the input gradient (the same set both ways).
        emulated: accepted precisions that are only emulated (fake-quant, no speed or memory gain); the planner never
            offers them, validation accepts them (tests and the reference use them).
        cpu_native: precisions that run natively only on CPUs with the matching instructions (bf16 dot products,
            int8 dot products) and are emulated elsewhere; see ``native_on_this_cpu``.
        reference: the precision the planner measures against and a job loads at before planning.
        static_shapes: pads token counts to buckets (True) or takes any row count.
        runs_on_cpu: its products run on the host CPU (no queue hand-off, torch threads shared).
        own_cpu_pool: its products run on a CPU thread pool of its own (ONNX Runtime's), not on torch's OpenMP
            workers, which then must sleep when idle or stay single-threaded (``kernels.cpu_threads``).
        weight_dtypes: storage dtype per accepted precision.
        summary: one line for ``lorad status`` and the docs.
    """

    name: str
    precisions: tuple[str, ...]
    emulated: tuple[str, ...]
    cpu_native: tuple[str, ...]
    reference: str
    static_shapes: bool
    runs_on_cpu: bool
    own_cpu_pool: bool
    weight_dtypes: dict[str, str]
    summary: str

    def check(self, precision: str) -> None:
        """Raise ValueError naming backend and precision unless this backend accepts ``precision``."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r} for backend {self.name!r}; choose one of {PRECISIONS}")
        if precision not in self.precisions:
            raise ValueError(
                f"backend {self.name!r} does not support precision {precision!r}; it supports {self.precisions}"
            )

    def planner_menu(self) -> tuple[str, ...]:
        """Precisions "auto" may choose on this machine besides the reference: real (not emulated) ones the hardware
        runs natively. The planner still prices each by measurement and drops any that is not faster."""
        menu = [p for p in self.precisions if p != self.reference and not self.is_emulated(p)]
        return tuple(menu)

    def unplanned(self) -> str:
        """The precision an "auto" job trains at while its model has no plan yet (the plan is measured after that job,
        see ``run_recipe``): bf16 where this machine runs it natively, else the reference. bf16 keeps fp32's exponent
        range and measured as fast as the plans on AVX512-BF16 with -0.06 % held-out loss on SmolLM2; integer formats
        are never chosen unmeasured."""
        return "bf16" if "bf16" in self.planner_menu() else self.reference

    def generation(self) -> str:
        """The precision the daemon loads its base model at for Generate: ``unplanned``'s, bf16 where this machine
        runs it natively (what its jobs train most layers at), else the reference. A generated token reads every
        weight once: SmolLM2 in bf16 reads 269 MB where fp32 read 538, the loaded model holds half the memory, and
        ``fused.small_rows_bf16`` streams it at the memory's speed (Zen 5, 2 threads: 65 -> 21 ms a token)."""
        return self.unplanned()

    def is_emulated(self, precision: str) -> bool:
        """True when ``precision`` runs here only as an emulation (no speed or memory gain on this machine)."""
        if precision in self.emulated:
            return True
        return precision in self.cpu_native and not native_on_this_cpu(precision).native


CAPABILITIES: dict[str, Capability] = {
    "torch": Capability(
        name="torch",
        precisions=("fp32", "bf16", "fp16", "w8a16", "w8a8", "w4a16"),
        emulated=("fp16", "w8a16", "w4a16"),
        cpu_native=("bf16", "w8a8"),
        reference="fp32",
        static_shapes=False,
        runs_on_cpu=True,
        own_cpu_pool=False,
        weight_dtypes={
            "fp32": "float32",
            "bf16": "bfloat16",
            "fp16": "float16",
            "w8a16": "int8",
            "w8a8": "int8",
            "w4a16": "int8",
        },
        summary=(
            "PyTorch on the CPU: fp32 reference; bf16 (oneDNN) and w8a8 (int8 GEMM) native where the CPU has bf16 / "
            "int8 dot-product instructions"
        ),
    ),
    "ort-cpu": Capability(
        name="ort-cpu",
        precisions=("fp32", "w8a8"),
        emulated=(),
        cpu_native=(),
        reference="fp32",
        static_shapes=False,
        runs_on_cpu=True,
        own_cpu_pool=True,
        weight_dtypes={"fp32": "float32", "w8a8": "int8"},
        summary="ONNX Runtime CPU EP: fp32 GEMM and int8 (VNNI) w8a8; one weight copy fed as a graph input",
    ),
    "qnn-htp": Capability(
        name="qnn-htp",
        precisions=("fp16", "w8a16", "w8a8", "w4a16"),
        emulated=(),
        cpu_native=(),
        reference="fp16",
        static_shapes=True,
        runs_on_cpu=False,
        own_cpu_pool=False,
        weight_dtypes={"fp16": "float16", "w8a16": "int8", "w8a8": "int8", "w4a16": "int4"},
        summary="Qualcomm Hexagon NPU via onnxruntime-qnn (a simulator on x86_64); token buckets; fp16 and QDQ",
    ),
}
BACKENDS: tuple[str, ...] = tuple(CAPABILITIES)


def capability(backend: str) -> Capability:
    """The capability row of ``backend``.

    Raises:
        ValueError: unknown backend (the message lists the known ones).
    """
    try:
        return CAPABILITIES[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}") from None


@dataclass(frozen=True)
class CpuFeature:
    """Whether this CPU multiplies in one reduced precision natively (bf16, or int8 for ``cpu_int8``), and why."""

    native: bool
    reason: str


def is_x86() -> bool:
    """Whether this is an x86 CPU (64- or 32-bit), the one test of it: compiler flags and the int8 weight format
    differ by it."""
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@functools.cache
def cpu_bf16() -> CpuFeature:
    """Detects native bf16 matmul support once: x86 AVX512-BF16 or AMX-BF16, ARM ``bf16`` (ARMv8.6 BFMMLA).

    Without it torch's bf16 matmul converts in software and is slower than fp32, so bf16 is not offered.
    """
    flags, err = cpu_flags()
    if err:
        return CpuFeature(False, err)
    machine = platform.machine()
    for f in ("amx_bf16", "avx512_bf16"):
        if f in flags:
            return CpuFeature(True, f"{machine} CPU has {f}")
    if "bf16" in flags:
        return CpuFeature(True, f"{machine} CPU has bf16 (BFMMLA)")
    return CpuFeature(False, f"{machine} CPU lacks bf16 instructions (no avx512_bf16/amx_bf16/bf16 flag)")


@functools.cache
def cpu_int8() -> CpuFeature:
    """Detects native int8 dot products once: x86 AVX512-VNNI, AVX-VNNI or AMX-INT8; ARM ``asimddp`` (SDOT) or
    ``i8mm`` (SMMLA). torch's int8 GEMM (``torch._int_mm``) runs ~1.7x faster than its bf16 GEMM with them (SmolLM2
    block shapes, 256 rows, Zen 5) and has no fast path without them."""
    flags, err = cpu_flags()
    if err:
        return CpuFeature(False, err)
    machine = platform.machine()
    for f in ("amx_int8", "avx512_vnni", "avx_vnni", "i8mm", "asimddp"):
        if f in flags:
            return CpuFeature(True, f"{machine} CPU has {f}")
    return CpuFeature(False, f"{machine} CPU lacks int8 dot-product instructions (no VNNI/AMX-INT8/SDOT/I8MM flag)")


def native_on_this_cpu(precision: str) -> CpuFeature:
    """Whether ``precision`` is native on this CPU (bf16 and w8a8; every other precision: no)."""
    if precision == "bf16":
        return cpu_bf16()
    if precision == "w8a8":
        return cpu_int8()
    return CpuFeature(False, f"{precision} has no native CPU path")


def cpu_flags() -> tuple[set[str], str]:
    """This CPU's feature flags from /proc/cpuinfo (x86 ``flags``, ARM ``Features``), and why they are empty if so."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set(), "cannot read /proc/cpuinfo"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return flags, ""
