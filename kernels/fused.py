"""Fused CPU kernels for the training step's elementwise chains, with the torch ops they replace as the fallback.

``fused_cpu.cpp`` is compiled once per machine with the system C++ compiler against the installed torch (6-10 s),
cached under ``cache_dir()`` by a hash of the source, torch version, compiler, flags and CPU features, and loaded as
torch ops (``torch.ops.lorad_fused``). ``make setup`` builds it; a process that finds no build compiles it when its
first model is built. Where it cannot be built (no compiler, an unexpected toolchain) or ``LORAD_FUSED_KERNELS=0``,
every function here computes the same math with torch ops: the numbers differ by float rounding only (the kernels'
exp is a polynomial, their sums run in another order), and each path gives the same bits when called twice on the
same operands, which is what the training nodes need to recompute instead of saving.

SmolLM2 at 256 tokens on the AMX Xeon, 16 paired interleaved steps: 411 -> 382 ms a step for the norm and SwiGLU
kernels. In isolation (2 threads, one layer's shapes): RMSNorm forward with its bf16 copy 66 -> 24 us, backward 95 -> 39
us, SwiGLU forward with its bf16 copy 179 -> 116 us, SwiGLU backward with its bf16 copy 610 -> 190 us; RoPE of q into
bf16 57 -> 19 us and back 82 -> 21 us (-7 ms a step in 16 pairs); the loss's softmax over ~200 bf16 logit rows of 49,152
words 8.5 -> 4.2 ms (-6 ms a step in 16 pairs); gate/up's LoRA terms inside the SwiGLU passes
(``lora_swiglu_forward``/``_backward``) 320 -> 220 us forward and 510 -> 350 us backward (-2.5 ms a step in 30 pairs);
causal attention on AMX tiles (``causal_attention_forward``/``_backward``, where the CPU has them) 719 -> 611 us forward
and 911 -> 818 us backward per layer inside the step (-6.9 ms a step in 24 pairs; on the AVX512-BF16 Zen 5, the same
kernels with vdpbf16ps register tiles: 1.06 -> 0.49 ms forward and 1.37 -> 1.22 ms backward a SmolLM2 layer at 214
tokens against the torch path, about -20 to -30 ms a step in two runs of 13 interleaved pairs); a bf16 GEMM's product
widened with its LoRA term in one pass (``widen_lowrank``: q/k/v/o/down outputs and every input gradient of a block)
where torch widened and then added the term through MKL's thin GEMM, 52 -> 25 us at [256, 576] and rank 8, even at [256,
1536] (-8.3 ms a step in two runs of 16 interleaved pairs); gate's and up's LoRA gradients inside the SwiGLU backward's
pass (``lora_swiglu_backward_grads``), 664 -> 522 us a layer with the thin products it replaces; and for every other
adapted layer, g, dB and the bf16 operand of its input-gradient GEMM from one pass over its output gradient
(``lora_out_grads``, -9 ms a step); the LoRA A gradients of the layers after an RMSNorm summed while the normed rows are
recomputed a tile at a time (``rms_norm_a_grads``, -5 ms a step).

On a 2-core AVX2 EPYC (2 threads, T = 214): ``lowrank_rows`` (h = x·Aᵀ of every adapted layer) 125 -> 75 us at
[214, 576] rank 8 and 235 -> 126 us at [214, 1536] against MKL's best layout; with the kernels' vectors split into the
machine's registers (fused_cpu.cpp, ``v16``), a SmolLM2 step of the default (ort-cpu fp32) path 2.624 -> 2.563 s and
2.752 -> 2.700 s (two alternating pairs of 12-step runs, the same losses to 7 digits); fp32 causal attention for fp32
training and eval (``causal_attention_f32_forward``/``_backward``, every CPU) 2.29 -> 1.34 ms forward and 9.1 -> 4.2
ms forward + backward a SmolLM2 layer against torch's SDPA, a step -106 and -151 ms (two runs of 12 interleaved
pairs).

On the Zen 5 (AVX512-BF16, 2 threads, SmolLM2 steps of the auto plan, medians of 30 same-batch pairs in one process):
o_proj's bf16 rows read as they are by ``lowrank_rows`` and ``lowrank_a_grads`` (no widened copies, no thin product)
-8.5 ms a step; the SwiGLU passes taking down_proj's h and dA from the act rows they hold, 1.23 -> 0.89 ms a layer in
the profiler; the q/k/v and MLP nodes as one call a direction (``lora_group_forward``, ``lora_mlp_forward``) -3.1 and
-5.5 ms; int8 members' g and dB from ``lora_out_grads`` -1.9 ms.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import Tensor

from lorad.kernels.capabilities import cpu_flags, is_x86

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("fused_cpu.cpp")
ENV_SWITCH = "LORAD_FUSED_KERNELS"  # "0" turns the kernels off (the torch fallback runs)
ENV_CACHE = "LORAD_KERNEL_CACHE"  # where builds are kept; default ~/.cache/lorad/kernels (XDG_CACHE_HOME honoured)


class FusedBuildError(RuntimeError):
    """The kernels could not be compiled (now or in an earlier process); the message holds the compiler's command and
    output."""


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$LORAD_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/lorad/kernels``, else
    ``~/.cache/lorad/kernels``."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lorad" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _flags(arch: bool) -> list[str]:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-trapping-math", "-w"]
    flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    flags += [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
    if arch:  # the build machine is the machine that runs it: use its whole vector unit
        flags += ["-march=native", "-mprefer-vector-width=512"] if is_x86() else ["-mcpu=native"]
    return flags


def _library_path(cache: Path, cxx: str, flags: list[str]) -> Path:
    """Where the build of this source, torch, compiler, flags and CPU lives: -march=native code for one CPU must not
    load on another (a home directory on two machines, a VM moved to another host) where it could fault."""
    key = hashlib.sha256()
    cpu = " ".join(sorted(cpu_flags()[0]))
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), cxx.encode(), " ".join(flags).encode(), cpu.encode()):
        key.update(part)
        key.update(b"\0")
    return cache / f"lorad_fused-{platform.machine()}-{key.hexdigest()[:16]}.so"


def build(cache: Path | None = None, *, retry: bool = False) -> Path:
    """Compiles ``fused_cpu.cpp`` into ``cache`` (default ``cache_dir()``) unless a build of this exact source,
    torch, compiler and flags is there; returns the library's path. Builders on one machine take turns (a lock
    file in ``cache``), so a second process waits for the first one's library instead of compiling it again; each
    writes a private file and renames it into place, so a reader never sees half a library.

    A failed build leaves a ``.failed`` file with the compiler's output next to where the library would be, and
    later calls raise at once instead of compiling again in every process (``retry=True``, as ``make setup`` passes,
    or deleting that file tries again; a new source, torch or compiler is a new build anyway).

    Raises:
        FusedBuildError: no compiler, or the build failed (now or before).
    """
    cxx = _compiler()
    if cxx is None:
        raise FusedBuildError("no C++ compiler found (set CXX, or install g++ or clang++)")
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed builder's process ends
        return _build_locked(cache, cxx, retry=retry)


def _build_paths(cache: Path, cxx: str) -> tuple[list[Path], Path]:
    """This machine's two possible libraries in ``cache`` (-march=native first, then generic) and the failure record."""
    outs = [_library_path(cache, cxx, _flags(arch)) for arch in (True, False)]
    return outs, outs[1].with_suffix(".failed")


def _build_locked(cache: Path, cxx: str, *, retry: bool) -> Path:
    outs, failed = _build_paths(cache, cxx)
    _prune(cache, keep={failed, *outs})
    for out in outs:
        if out.exists():
            with contextlib.suppress(OSError):
                os.utime(out)  # in use: what _prune goes by
            return out
    if failed.exists() and not retry:
        raise FusedBuildError(f"building the fused kernels failed before (see {failed}):\n{failed.read_text()}")
    errors = []
    for arch, out in zip((True, False), outs, strict=True):  # a compiler that rejects -march=native builds generic
        fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=cache)
        os.close(fd)
        cmd = [cxx, str(SOURCE), "-o", tmp, *_flags(arch)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            Path(tmp).replace(out)
            failed.unlink(missing_ok=True)  # an earlier failure (a missing header since installed) is over
            return out
        Path(tmp).unlink(missing_ok=True)
        errors.append(f"$ {' '.join(cmd)}\n{proc.stderr.strip()[-2000:]}")
    failed.write_text("\n".join(errors) + "\n")
    raise FusedBuildError("building the fused kernels failed:\n" + "\n".join(errors))


UNUSED_DAYS = 30  # a cached build no process has asked for in this long is deleted (another source, torch or CPU)


def _prune(cache: Path, keep: set[Path]) -> None:
    """Deletes what other builds left in ``cache``: libraries and failure records not used for ``UNUSED_DAYS`` (a
    library's time is renewed whenever ``build`` finds it), and temporary files of builders that were killed (the
    caller holds the build lock, so no builder is writing one). Best effort: a file that cannot go stays."""
    cutoff = time.time() - UNUSED_DAYS * 86400
    for p in cache.glob("lorad_fused-*"):
        if p in keep:
            continue
        with contextlib.suppress(OSError):
            if p.suffix == ".tmp" or p.stat().st_mtime < cutoff:
                p.unlink()


_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ops": the loaded namespace or None, decided once per process; "detail": path or why not


def kernels() -> Any | None:
    """The fused ops (``torch.ops.lorad_fused``), building them on first use, or None where they are off or cannot be
    built (logged once, with the reason). Decided once per process: a training step never mixes the two paths."""
    with _lock:
        if "ops" not in _state:
            _state["ops"], _state["detail"] = _load()
        return _state["ops"]


def _load() -> tuple[Any | None, str]:
    """The kernels' namespace, or None; and the library's path, or why not."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("fused_kernels_off", reason=f"{ENV_SWITCH}=0")
        return None, f"off ({ENV_SWITCH}=0)"
    try:
        path = build()
        torch.ops.load_library(str(path))
    except (FusedBuildError, OSError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0].rstrip(":")
        log.warning("fused_kernels_unavailable", error=reason, fallback="torch ops")
        return None, f"unavailable: {reason}"
    return torch.ops.lorad_fused, str(path)


def describe() -> tuple[bool, str]:
    """Whether this process's training steps run the kernels, and the library in use or why not, for status displays;
    it never builds or loads anything. Before the process's first model decides (``kernels()``), it says whether a
    build for this machine is ready."""
    with _lock:
        decided, ops, detail = "ops" in _state, _state.get("ops"), _state.get("detail", "")
    if decided:
        if ops is None:
            return False, f"{detail}; torch ops run instead"
        unit = ops.attention_bf16_unit()
        tiles = f"; attention on {unit}" if unit else ""
        return True, f"active ({detail}){tiles}"
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False, f"off ({ENV_SWITCH}=0); torch ops run instead"
    cxx = _compiler()
    if cxx is None:
        return False, "unavailable: no C++ compiler found (set CXX, or install g++ or clang++); torch ops run instead"
    outs, failed = _build_paths(cache_dir(), cxx)
    ready = [p for p in outs if p.exists()]
    if ready:
        return False, f"not loaded yet: the first model loads {ready[0]}"
    if failed.exists():
        return False, f"unavailable: an earlier build failed (see {failed}); torch ops run instead"
    return False, "not built yet: the first model compiles them (once per machine, about 10 s)"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Runs the block with the torch fallback (tests compare the two paths); not for use inside a training step."""
    kernels()  # decided first, so there is always a decision to put back
    with _lock:
        saved = dict(_state)
        _state.update(ops=None, detail="off (disabled in this block)")
    try:
        yield
    finally:
        with _lock:
            _state.update(saved)


def _rows_ok(*ts: Tensor) -> bool:
    """Whether the kernels take these operands: float32 matrices with contiguous columns."""
    return all(t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1 for t in ts)


def rms_norm_forward(
    x: Tensor, weight: Tensor, eps: float, *, want_bf16: bool = False
) -> tuple[Tensor, Tensor | None, Tensor]:
    """RMSNorm of the rows of ``x`` [R, C]: ``(y, y as bf16 or None, rstd [R, 1])`` with
    ``rstd = 1/sqrt(mean(x²) + eps)`` and ``y = x·rstd·weight``."""
    ops = kernels()
    if ops is not None and _rows_ok(x) and weight.dtype == torch.float32:
        y, yb, rstd = ops.rms_norm_fwd(x, weight.contiguous(), float(eps), want_bf16)
        return y, (yb if want_bf16 else None), rstd
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = x * rstd * weight
    return y, (y.to(torch.bfloat16) if want_bf16 else None), rstd


def rms_norm_apply(x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """``rms_norm_forward``'s ``y`` from ``x`` and its ``rstd``, bit for bit on the same path."""
    ops = kernels()
    if ops is not None and _rows_ok(x) and weight.dtype == torch.float32:
        out: Tensor = ops.rms_norm_apply(x, rstd.contiguous(), weight.contiguous())
        return out
    return x * rstd * weight


def rms_norm_a_grads(x: Tensor, rstd: Tensor, weight: Tensor, g: Tensor, *, scaling: float) -> Tensor | None:
    """``s·gᵀ·rms_norm_apply(x, rstd, weight)`` [k, C] (the LoRA A gradients of layers reading the normed rows, ``g``
    [R, k] their rank-space gradient, any strides) with the rows recomputed a tile at a time and never written out,
    where ``a_grads`` reads a recomputed [R, C] copy through a thin product. None where the kernels do not run this
    (no build, a width that is not a multiple of 16, other layouts): the caller recomputes the rows."""
    ops = kernels()
    if ops is None or not _rows_ok(x) or x.shape[1] % 16 or not _fp32(g) or weight.dtype != torch.float32:
        return None
    out: Tensor = ops.rms_norm_a_grads(x, rstd.contiguous(), weight.contiguous(), g, float(scaling))
    return out


def rms_norm_backward(g: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """dL/dx of ``y = x·rstd·weight`` for the output gradient ``g`` [R, C] (the weight is frozen)."""
    ops = kernels()
    if ops is not None and _rows_ok(g, x) and weight.dtype == torch.float32:
        out: Tensor = ops.rms_norm_bwd(g, x, rstd.contiguous(), weight.contiguous())
        return out
    gw = g * weight
    xhat = x * rstd
    return rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))


def swiglu_forward(gate: Tensor, up: Tensor, *, want_bf16: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(silu(gate)·up, the same as bf16 or None)`` for [R, F] operands (column blocks of a wider tensor are fine)."""
    ops = kernels()
    if ops is not None and _rows_ok(gate, up):
        act, actb = ops.swiglu_fwd(gate, up, want_bf16)
        return act, (actb if want_bf16 else None)
    act = F.silu(gate).mul_(up)
    return act, (act.to(torch.bfloat16) if want_bf16 else None)


def swiglu_backward(
    d_act: Tensor, gate: Tensor, up: Tensor, *, want_bf16: bool = False
) -> tuple[Tensor, Tensor | None]:
    """The gradients of ``act = silu(gate)·up`` side by side, ``[d_gate | d_up]`` [R, 2F] float32, and the same as
    bf16 or None: the left operand of the stacked gate/up weight's input-gradient GEMM."""
    ops = kernels()
    if ops is not None and _rows_ok(d_act, gate, up):
        dgu, dgub = ops.swiglu_bwd(d_act, gate, up, want_bf16)
        return dgu, (dgub if want_bf16 else None)
    f = gate.shape[1]
    dgu = torch.empty(gate.shape[0], 2 * f, dtype=torch.float32)
    torch.mul(d_act, F.silu(gate), out=dgu[:, f:])
    dgu[:, :f] = torch.ops.aten.silu_backward(d_act * up, gate)  # fused dy·s·(1 + x·(1 − s))
    return dgu, (dgu.to(torch.bfloat16) if want_bf16 else None)


def _lora_ok(prods: Sequence[Tensor], h: Tensor, bs: Sequence[Tensor]) -> bool:
    """Whether the LoRA SwiGLU kernels take these operands: bf16 products with contiguous columns, fp32 h and Bs."""
    bf16 = all(p.dtype == torch.bfloat16 and p.dim() == 2 and p.stride(1) == 1 for p in prods)
    return bf16 and h.dtype == torch.float32 and all(b.dtype == torch.float32 for b in bs)


def _any_rows_ok(x: Tensor) -> bool:
    """Whether the kernels take ``x`` as rows: a float32 or bfloat16 matrix with contiguous columns, C a multiple of
    16 (bf16 rows are widened a tile at a time, exactly)."""
    return x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 16 == 0


def lowrank_rows(x: Tensor, a: Tensor) -> Tensor:
    """``h = x·aᵀ`` [R, k] for rows ``x`` [R, C] (float32, or bfloat16 as exactly widened) and ``a`` [k, C] (a LoRA
    layer's A, or several stacked): the rank-space rows the LoRA terms multiply. One pass over ``x`` where the kernels
    run (C a multiple of 16, contiguous columns), else torch's ``[k, C]·[C, R]`` product, returned as a transposed view
    (MKL runs the thin ``[R, C]·[C, k]`` layout at 4-20x the time)."""
    ops = kernels()
    if ops is not None and _any_rows_ok(x) and _rows_ok(a) and a.shape[0] > 0:
        out: Tensor = ops.lowrank_rows(x, a)
        return out
    return (a @ x.float().t()).t()


def lowrank_a_grads(x: Tensor, g: Tensor, *, scaling: float) -> Tensor:
    """``scaling·gᵀ·x`` [k, C]: a LoRA layer's A gradient from its input rows ``x`` [R, C] (float32, or bfloat16 as
    exactly widened) and its rank-space gradient ``g`` [R, k]. One pass over ``x`` where the kernels run (as
    ``lowrank_rows`` takes ``x``; the sums over rows in a fixed order whatever the thread count), else torch's thin
    product over the widened rows."""
    ops = kernels()
    if ops is not None and _any_rows_ok(x) and _fp32(g):
        out: Tensor = ops.lowrank_a_grads(x, g, float(scaling))
        return out
    return (g.t() @ x.float()).mul_(scaling)


SMALL_ROWS = 2
"""Rows up to which ``small_rows_bf16`` runs a bf16 product instead of oneDNN's GEMM, which repacks the whole weight
every call. Zen 5, 2 threads, weights streamed from memory as in generation (SmolLM2's shapes): at one row 1.7-4.3x
faster (21-32 GB/s, the memory's speed; the 49152x576 lm_head 3.6 -> 2.2 ms), at two 1.6-2.3x; at four it won on some
shapes and lost on others (0.77-1.63x), at eight it lost on most."""


def small_rows_bf16(x: Tensor, w: Tensor) -> Tensor | None:
    """``x·wᵀ`` [M, N] in bfloat16 for at most ``SMALL_ROWS`` rows ``x`` [M, K] (float32 rounded to bf16, or bf16;
    contiguous columns) and a contiguous bf16 weight ``w`` [N, K]: one read of the weight, fp32 sums, one bf16
    rounding, what the bf16 GEMM returns up to the order of its sums (generation's per-token products). None where
    the kernels do not run or the operands are not these (the caller's GEMM then)."""
    ops = kernels()
    if (
        ops is None
        or x.dim() != 2
        or not 1 <= x.shape[0] <= SMALL_ROWS
        or x.stride(1) != 1
        or x.dtype not in (torch.float32, torch.bfloat16)
        or w.dtype != torch.bfloat16
        or not w.is_contiguous()
    ):
        return None
    out: Tensor = ops.small_rows_bf16(x, w)
    return out


def quantize_rows_i8(a: Tensor, col_scale: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """``_quant.quantize_rows(a * col_scale)`` (int8 [T, K], float32 scales [T, 1]) in one pass over float32 rows
    ``a`` [T, K] with contiguous columns, the same bits as torch's ten ops; None where the kernels do not run or the
    operands are not these (the caller's torch ops then)."""
    ops = kernels()
    if ops is None or not _rows_ok(a) or (col_scale is not None and col_scale.dtype != torch.float32):
        return None
    got: tuple[Tensor, Tensor] = ops.quantize_rows_i8(a, _NO_BIAS if col_scale is None else col_scale.contiguous())
    return got


def int8_rescale(acc: Tensor, row_scale: Tensor, col_scale: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """``acc.float().mul_(row_scale).mul_(col_scale).add_(bias)`` (the factors given) in one pass over an int8 GEMM's
    int32 sums ``acc`` [T, N]: float32 [T, N], the same bits; None where the kernels do not run."""
    ops = kernels()
    if ops is None or acc.dtype != torch.int32 or not acc.is_contiguous():
        return None
    cols = _NO_BIAS if col_scale is None else col_scale.contiguous()
    out: Tensor = ops.int8_rescale(acc, row_scale, cols, _NO_BIAS if bias is None else bias.contiguous())
    return out


def widen_lowrank(prod: Tensor, h: Tensor, m: Tensor, *, scaling: float, bias: Tensor | None = None) -> Tensor:
    """``(float(prod) + bias) + scaling·h·m`` [R, N] float32 from a bf16 GEMM's product ``prod`` [R, N] and a rank-k
    term ``h`` [R, k]·``m`` [k, N] (a LoRA layer's ``s·h·Bᵀ`` on its frozen output, or ``s·g·A`` on its input
    gradient): one pass where the kernels run, else widening and ``addmm_``."""
    ops = kernels()
    if ops is not None and prod.dtype == torch.bfloat16 and prod.dim() == 2 and prod.stride(1) == 1 and _fp32(h, m):
        out: Tensor = ops.widen_lowrank(prod, h, m, _NO_BIAS if bias is None else bias.contiguous(), float(scaling))
        return out
    y = prod.float()
    if bias is not None:
        y.add_(bias)
    return y.addmm_(h, m, alpha=scaling)


def _fp32(*ts: Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.dim() == 2 for t in ts)


_NO_BIAS = torch.empty(0)


def lora_gate_up(prods: Sequence[Tensor], h: Tensor, bs: Sequence[Tensor], *, scaling: float) -> tuple[Tensor, Tensor]:
    """Gate and up in float32 from their bf16 products ``prods`` [R, F] and LoRA terms: ``float(p) + s·h_i·B_iᵀ``
    with ``B_i`` in ``bs`` and ``h`` [R, rg + ru] holding both members' ``x·A_iᵀ`` side by side (torch ops; the
    kernels never materialise gate and up)."""
    (pg, pu), (bg, bu) = prods, bs
    rg = bg.shape[1]
    gate = pg.float().addmm_(h[:, :rg], bg.t(), alpha=scaling)
    up = pu.float().addmm_(h[:, rg:], bu.t(), alpha=scaling)
    return gate, up


def lora_swiglu_forward(
    prods: Sequence[Tensor],
    h: Tensor,
    bs: Sequence[Tensor],
    *,
    scaling: float,
    want_bf16: bool = False,
    a_next: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(silu(gate)·up, the same as bf16 or None, its rank-space rows or None)`` with gate and up as ``lora_gate_up``
    gives them: one pass over the bf16 products where the kernels run (gate and up exist a tile of rows at a time),
    else ``lora_gate_up`` and ``swiglu_forward``. Given the next layer's A ``a_next`` [r, F] (down_proj's), the pass
    also takes ``act·a_nextᵀ`` [R, r] while each tile is in cache, where the kernels run and F is a multiple of 16;
    None otherwise (the caller's ``lowrank_rows`` then)."""
    ops = kernels()
    if ops is not None and _lora_ok(prods, h, bs):
        nxt = a_next is not None and a_next.dtype == torch.float32 and a_next.stride(1) == 1 and h.shape[0] > 0
        nxt = nxt and prods[0].shape[1] % 16 == 0
        act, actb, hn = ops.lora_swiglu_fwd(*prods, h, *bs, float(scaling), want_bf16, a_next if nxt else _NO_BIAS)
        return act, (actb if want_bf16 else None), (hn if nxt else None)
    act, actb = swiglu_forward(*lora_gate_up(prods, h, bs, scaling=scaling), want_bf16=want_bf16)
    return act, actb, None


def lora_swiglu_backward(
    d_act: Tensor, prods: Sequence[Tensor], h: Tensor, bs: Sequence[Tensor], *, scaling: float, want_bf16: bool = False
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``swiglu_backward``'s ``[d_gate | d_up]`` (and its bf16 copy or None) for ``lora_swiglu_forward``'s operands,
    plus its ``act`` again, bit for bit (down_proj's dA multiplies it)."""
    ops = kernels()
    if ops is not None and _lora_ok(prods, h, bs) and _rows_ok(d_act):
        dgu, dgub, act = ops.lora_swiglu_bwd(d_act, *prods, h, *bs, float(scaling), want_bf16)
        return dgu, (dgub if want_bf16 else None), act
    gate, up = lora_gate_up(prods, h, bs, scaling=scaling)
    act, _ = swiglu_forward(gate, up)
    dgu, dgub = swiglu_backward(d_act, gate, up, want_bf16=want_bf16)
    return dgu, dgub, act


def lora_swiglu_backward_grads(
    d_act: Tensor, prods: Sequence[Tensor], h: Tensor, bs: Sequence[Tensor], g_next: Tensor, *, scaling: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:
    """``lora_swiglu_backward``'s bf16 ``[d_gate | d_up]``, with the LoRA gradients of gate, up and the layer after
    them taken in the same pass while each tile of fp32 gradients and of ``act`` is in cache (neither is written out):
    ``(d_gu_bf16, dA_next, g, dB_g, dB_u)`` with ``dA_next`` [r, F] = ``s·g_nextᵀ·act`` for the next layer's
    (down_proj's) rank-space gradient rows ``g_next`` [R, r] (any strides), ``g`` [R, r_g + r_u] =
    ``[d_gate·B_g | d_up·B_u]``, and each ``dB`` [F, r] = ``s·d_upᵀ·h_u`` (gate likewise; contiguous, the layout of
    lora_B, so autograd keeps it as it is). None where the kernels do not run this (no build, other operands, an
    intermediate size that is not a multiple of 16): the caller then takes ``lora_swiglu_backward``'s fp32 gradients
    and ``act`` and the thin products. The sums run in a fixed order whatever the thread count; they differ from
    MKL's by float rounding."""
    ops = kernels()
    if ops is None or not (_lora_ok(prods, h, bs) and _rows_ok(d_act)) or prods[0].shape[1] % 16 or not _fp32(g_next):
        return None
    dgub, da_next, g, db_g, db_u = ops.lora_swiglu_bwd_grads(d_act, *prods, h, *bs, g_next, float(scaling))
    return dgub, da_next, g, db_g, db_u


def lora_out_grads(
    dys: Sequence[Tensor], h: Tensor, bs: Sequence[Tensor], *, scaling: float, want_bf16: bool
) -> tuple[Tensor | None, Tensor, list[Tensor]] | None:
    """The LoRA gradients of layers that share the stacked ``h`` [R, Σr], from their fp32 output gradients ``dys``
    [R, out_i], in one pass over each gradient row: the rows side by side in bf16 when ``want_bf16`` (the stacked
    input-gradient GEMM's operand, rounded as ``.to(torch.bfloat16)`` rounds; else None), ``g`` [R, Σr] =
    ``[dy_i·B_i …]`` and each ``dB_i`` [out_i, r_i] = ``s·dy_iᵀ·h_i`` (contiguous, the layout of lora_B), where the
    thin products read every gradient twice more. None where the kernels do not run this (no build, an output width
    that is not a multiple of 16, other dtypes or layouts): the caller takes the thin products. The sums run in a
    fixed order whatever the thread count; they differ from MKL's by float rounding."""
    ops = kernels()
    if ops is None or not all(_rows_ok(d) and d.shape[1] % 16 == 0 for d in dys) or not _fp32(h, *bs):
        return None
    packed, g, dbs = ops.lora_out_grads(list(dys), h, list(bs), float(scaling), want_bf16)
    return (packed if want_bf16 else None), g, list(dbs)


def lora_mlp_forward(  # noqa: PLR0917 (the node's operands, positionally as the op takes them)
    x: Tensor,
    norm: tuple[Tensor, float],
    w_gu: Tensor,
    a_gu: Tensor,
    bs: Sequence[Tensor],
    w_d: Tensor,
    a_d: Tensor,
    b_d: Tensor,
    *,
    scaling: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:
    """The LoRA SwiGLU node's forward in one call (server/engine/models/mlp.py, its common case): ``(out, rstd, the
    gate/up bf16 product, h_gu, h_d)`` for the norm's input rows ``x`` [R, C]; the same kernels and GEMMs as the node's
    Python composition, in its order, so the same bits. None where the kernels do not run."""
    ops = kernels()
    if ops is None:
        return None
    w, eps = norm
    got: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] = ops.lora_mlp_fwd(
        x, w.contiguous(), float(eps), w_gu, a_gu, *bs, w_d, a_d, b_d, float(scaling)
    )
    return got


def lora_mlp_backward(  # noqa: PLR0917
    dout: Tensor,
    saved: Sequence[Tensor],
    norm: tuple[Tensor, float],
    w_gu: Tensor,
    bs: Sequence[Tensor],
    w_d: Tensor,
    a_d: Tensor,
    b_d: Tensor,
    *,
    scaling: float,
    need_x: bool,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``lora_mlp_forward``'s backward from float32 rows ``dout`` [R, C] and what it saved (``x``, ``rstd``, the
    product, ``h_gu``, ``h_d``, ``a_gu``): ``(dx or None, dA_gu [rg + ru, C], dB_g, dB_u, dA_d, dB_d)``."""
    ops = kernels()
    assert ops is not None, "lora_mlp_backward without the kernels that ran its forward"
    x, rstd, prod, h_gu, h_d, a_gu = saved
    w = norm[0].contiguous()
    dx, da_gu, dbg, dbu, da_d, db_d = ops.lora_mlp_bwd(
        dout, x, rstd, w, w_gu, a_gu, *bs, prod, h_gu, w_d, a_d, b_d, h_d, float(scaling), need_x
    )
    return (dx if need_x else None), da_gu, dbg, dbu, da_d, db_d


def lora_group_forward(  # noqa: PLR0917
    x: Tensor,
    norm: tuple[Tensor, float],
    w: Tensor,
    a: Tensor,
    bs: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    *,
    scaling: float,
) -> tuple[list[Tensor], Tensor, Tensor] | None:
    """The forward of layers reading one normed input (lora_group.py's node, its common case: q/k/v) in one call:
    ``(each member's output [R, out_i], rstd, h)`` for the norm's input rows ``x`` [R, C], their stacked bf16 weight
    ``w`` and ``a`` = ``[A_1; …]``; the same kernels and GEMMs as the node's Python composition, in its order, so the
    same bits. None where the kernels do not run."""
    ops = kernels()
    if ops is None:
        return None
    nw, eps = norm
    bias_list = [_NO_BIAS if b is None else b.contiguous() for b in biases]
    outs, rstd, h = ops.lora_group_fwd(x, nw.contiguous(), float(eps), w, a, list(bs), bias_list, float(scaling))
    return list(outs), rstd, h


def lora_group_backward(
    dys: Sequence[Tensor],
    saved: Sequence[Tensor],
    norm: tuple[Tensor, float],
    w: Tensor,
    bs: Sequence[Tensor],
    *,
    scaling: float,
    need_x: bool,
) -> tuple[Tensor | None, Tensor, list[Tensor]]:
    """``lora_group_forward``'s backward from the members' float32 output-gradient rows and what it saved (``x``,
    ``rstd``, ``h``, ``a``): ``(dx or None, dA [Σr, C], [dB_i])``."""
    ops = kernels()
    assert ops is not None, "lora_group_backward without the kernels that ran its forward"
    x, rstd, h, a = saved
    dx, da, dbs = ops.lora_group_bwd(
        list(dys), x, rstd, norm[0].contiguous(), w, a, list(bs), h, float(scaling), need_x
    )
    return (dx if need_x else None), da, list(dbs)


def rope_forward(x: Tensor, cos: Tensor, sin: Tensor, *, bf16: bool) -> Tensor:
    """RoPE of x [B, T, H, D] (fp32) by the [T, D] tables into contiguous [B, H, T, D] rows, fp32 or (``bf16``) rounded
    to bf16 once: ``y1 = x1·c1 − x2·s1``, ``y2 = x2·c2 + x1·s2`` over the halves of D, computed in fp32."""
    ops = kernels()
    if ops is not None and x.dtype == torch.float32 and x.dim() == 4 and x.stride(3) == 1:
        out: Tensor = ops.rope_fwd(x, cos.float().contiguous(), sin.float().contiguous(), bf16)
        return out
    b, t, h, d = x.shape
    xt = x.transpose(1, 2)
    r = torch.mul(xt, cos, out=torch.empty(b, h, t, d))
    half = d // 2
    r[..., :half].addcmul_(xt[..., half:], sin[:, :half], value=-1.0)
    r[..., half:].addcmul_(xt[..., :half], sin[:, half:])
    return r.to(torch.bfloat16) if bf16 else r


def rope_backward(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The gradient of ``rope_forward`` for g [B, H, T, D] (bf16 or fp32): contiguous fp32 [B, T, H, D] rows,
    ``dx1 = g1·c1 + g2·s2``, ``dx2 = g2·c2 − g1·s1``."""
    ops = kernels()
    if ops is not None and g.dtype in (torch.bfloat16, torch.float32) and g.is_contiguous():
        out: Tensor = ops.rope_bwd(g, cos.float().contiguous(), sin.float().contiguous())
        return out
    b, h, t, d = g.shape
    dx = torch.empty(b, t, h, d)
    dxt = dx.transpose(1, 2)
    torch.mul(g, cos, out=dxt)
    half = d // 2
    dxt[..., :half].addcmul_(g[..., half:], sin[:, half:])
    dxt[..., half:].addcmul_(g[..., :half], sin[:, :half], value=-1.0)
    return dx


def softmax_xent_(logits: Tensor, labels: Tensor, denom: float | None) -> Tensor:
    """Sum over rows of ``lse - logit[label]`` for fp32 ``logits`` [rows, V] (torch ops); with ``denom``, turns
    ``logits`` in place into the gradient ``(softmax - onehot) / denom``."""
    target = logits.gather(1, labels[:, None]).squeeze(1)
    # logsumexp by hand, in place: one exp pass shared with the softmax (torch.logsumexp makes its own
    # temporaries: 99 vs 55 ms for lse + softmax at [255, 49152], 1 thread; same lse bit for bit).
    m = logits.amax(dim=-1, keepdim=True)
    e = torch.exp_(logits.sub_(m))  # logits are not needed again
    z = e.sum(dim=-1, keepdim=True)
    lse = (m + z.log()).squeeze(1)
    if denom is not None:
        p = e.div_(z)  # softmax
        p[torch.arange(labels.shape[0]), labels] -= 1.0
        p.div_(denom)
    return (lse - target).sum()


SOFTMAX_ROWS = 16  # the torch path widens this many bf16 logit rows at a time (a [16, V] fp32 buffer)


def softmax_xent_bf16_(logits: Tensor, labels: Tensor, denom: float | None) -> Tensor:
    """``softmax_xent_`` for bf16 logit rows [rows, V] (an lm_head GEMM's product), computed in fp32: the summed
    loss, and with ``denom`` the gradient rows written back into ``logits``, rounded to bf16. One kernel call (three
    passes per row in cache) where the kernels run; else ``SOFTMAX_ROWS`` rows at a time, widened, through
    ``softmax_xent_`` and copied back."""
    ops = kernels()
    if ops is not None and logits.dim() == 2 and logits.stride(1) == 1:
        losses: Tensor = ops.softmax_xent_bf16_(logits, labels.contiguous(), -1.0 if denom is None else float(denom))
        return losses.sum()
    total = logits.new_zeros((), dtype=torch.float32)
    for r in range(0, logits.shape[0], SOFTMAX_ROWS):
        part = logits[r : r + SOFTMAX_ROWS]
        rows = part.float()
        total = total + softmax_xent_(rows, labels[r : r + SOFTMAX_ROWS], denom)
        if denom is not None:
            part.copy_(rows)  # the gradient rows, rounded to bf16
    return total


def causal_attention_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor] | None:
    """Causal grouped-query attention of q [B, H, T, D] over k, v [B, KV, T, D] on AMX tiles or with AVX512-BF16 dot
    products: ``(out, lse, vr)``, the bf16 rows [B, T, H*D] o_proj multiplies, each row's fp32 log-sum-exp of its
    scaled scores [B, H, T], and v's bf16 rows for the backward. The products run in bf16 with fp32 accumulation and
    only over the causal half; the softmax is fp32, its probabilities rounded to bf16 for the P·V product. None where
    the kernels do not run it (not built, a CPU with neither, a head dim the kernels do not take: they say which): the
    caller's torch path runs then."""
    ops = kernels()
    if ops is None or not ops.attention_bf16_ready(int(q.shape[-1])):
        return None
    out, lse, vr = ops.causal_attention_fwd(q, k, v, float(scale))
    return out, lse, vr


def causal_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, vr: Tensor, lse: Tensor, *, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq [B, H, T, D], dk, dv [B, KV, T, D], fp32) of ``causal_attention_forward`` for the output
    gradient ``dout`` [B, T, H*D]; scores and probabilities are recomputed from ``lse``. Only after that forward ran
    the kernels (so their library is loaded)."""
    dq, dk, dv = torch.ops.lorad_fused.causal_attention_bwd(dout, q, k, vr, lse, float(scale))
    return dq, dk, dv


def attention_f32_takes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether ``causal_attention_f32_forward`` runs for these operands here: the kernels are loaded, q, k and v are
    float32 with contiguous head dims, and the head dim is a multiple of 16. Elsewhere the caller's torch path runs."""
    ops = kernels()
    if ops is None or any(t.dtype != torch.float32 or t.stride(-1) != 1 for t in (q, k, v)):
        return False
    return bool(ops.attention_f32_ready(int(q.shape[-1])))


def causal_attention_f32_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal grouped-query attention of float32 q [B, H, T, D] over k, v [B, KV, T, D] in fp32, over the causal half
    only: ``(out, lse)``, the rows [B, T, H*D] o_proj multiplies and each row's log-sum-exp of its scaled scores
    [B, H, T]. Only where ``attention_f32_takes`` says so."""
    out, lse = torch.ops.lorad_fused.causal_attention_f32_fwd(q, k, v, float(scale))
    return out, lse


def causal_attention_f32_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, *, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq [B, H, T, D], dk, dv [B, KV, T, D]) of ``causal_attention_f32_forward`` for the float32 output
    gradient ``dout`` [B, T, H*D], the probabilities recomputed from ``lse``. Only after that forward ran the
    kernels."""
    dq, dk, dv = torch.ops.lorad_fused.causal_attention_f32_bwd(dout.float(), q, k, v, lse, float(scale))
    return dq, dk, dv


def main() -> int:
    """Builds the kernels now (``make setup`` runs it) and prints where, or why not."""
    try:
        path = build(retry=True)
    except FusedBuildError as exc:
        print(f"fused kernels not built; training uses torch ops instead.\n{exc}")
        return 0  # not an error: the fallback computes the same math
    print(f"fused kernels: {path}")
    return 0
