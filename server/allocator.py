"""The daemon's malloc: tcmalloc when this glibc system has it, else the C library's own (``training.allocator``).

A training step allocates and frees a few thousand tensors, most of them 0.3-1.5 MB, while the activations saved for
the backward stay. glibc's heap fragments between those: at the end of a SmolLM2 forward it holds ~150 MB that is
free but resident, and the peak RSS counts it. tcmalloc's size-classed spans reuse that memory. Measured on SmolLM2
at bf16, 25 steps, two interleaved pairs of separate processes (2 threads, Intel Xeon with AMX): peak RSS 1066 ->
922 MB, a step 542 -> 481-507 ms. jemalloc gave the same peak as tcmalloc (933 MB) and no speed-up; a lower glibc mmap
threshold (256 KB) reached 904 MB but made a step twice as long (every big tensor freshly mapped).

A malloc must be in place before the first allocation, so ``lorad serve`` re-executes itself once with ``LD_PRELOAD``
naming the library (``preload_env``). Android's bionic and other C libraries are left alone: the glibc heap is what
fragments.
"""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

from lorad.server.config import ConfigError, serve_config

# Debian/Ubuntu package libtcmalloc-minimal4 (gperftools): no heap profiler, the fastest variant; then the full one.
_LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIB_DIRS = ("/usr/lib/{multiarch}", "/lib/{multiarch}", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class AllocatorError(RuntimeError):
    """``training.allocator = "tcmalloc"`` and this system cannot provide it; the message says what to install."""


def find_tcmalloc(dirs: tuple[str, ...] | None = None) -> Path | None:
    """The first tcmalloc shared library in the system library folders (or ``dirs``), if any."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    for d in dirs if dirs is not None else tuple(p.format(multiarch=multiarch) for p in _LIB_DIRS):
        for name in _LIBRARIES:
            lib = Path(d) / name
            if lib.is_file():
                return lib
    return None


def preload_env(setting: str, env: Mapping[str, str], *, lib: Path | None = None) -> dict[str, str] | None:
    """The environment to re-execute ``lorad serve`` with so that tcmalloc serves it, or None to go on as is.

    ``setting`` is a validated ``training.allocator``. None when it is ``"system"``, when ``LD_PRELOAD`` already
    names a malloc (tcmalloc, as in the re-executed process, which so never re-executes again; or one the user chose,
    such as jemalloc), or (``"auto"``) when the C library is not glibc or no tcmalloc is installed. ``lib`` overrides
    the search (tests). Which malloc then serves the process is ``engine.models.heap.malloc_in_use``.

    Raises:
        AllocatorError: ``setting`` is ``"tcmalloc"`` and it cannot be loaded here.
    """
    if setting == "system" or "malloc" in env.get("LD_PRELOAD", ""):
        return None
    lib = lib or find_tcmalloc()
    glibc = platform.libc_ver()[0] == "glibc"
    if lib is None or not glibc:
        if setting == "tcmalloc":
            why = "the C library is not glibc" if not glibc else "no libtcmalloc_minimal.so.4 or libtcmalloc.so.4"
            raise AllocatorError(
                f"training.allocator='tcmalloc' but {why} on this system; install the package libtcmalloc-minimal4 "
                "(Debian/Ubuntu) or set training.allocator = 'auto' or 'system'"
            )
        return None
    preload = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    return {**env, "LD_PRELOAD": preload}


def reexec_with_allocator(argv: Sequence[str]) -> int | None:
    """Runs ``lorad serve argv`` again in this interpreter with tcmalloc preloaded when its configuration wants it
    (does not return then); otherwise returns None to go on, or 2 after printing why the configured malloc cannot be
    had. Called before the daemon's modules (and torch) are imported: the first process stays small and quick.
    A configuration error is left to the daemon's own start, which reports it."""
    try:
        cfg = serve_config(argv)
    except ConfigError:
        return None
    try:
        env = preload_env(cfg.training.allocator, os.environ)
    except AllocatorError as exc:
        print(f"lorad: {exc}", file=sys.stderr)
        return 2
    if env is not None:
        cmd = [sys.executable, "-m", "lorad.server", *argv]
        os.execve(cmd[0], cmd, env)
    return None
