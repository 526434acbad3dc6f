"""How torch's OpenMP workers share the cores with a backend that runs its products on a thread pool of its own.

On ``ort-cpu`` every frozen product runs on ONNX Runtime's intra-op pool (all cores, idle workers sleep), and what is
left (attention, norms, RoPE, SwiGLU, the loss, the LoRA terms) runs on torch's OpenMP workers. libgomp lets an idle
worker spin for a while before it sleeps, so after each torch op a spinning worker holds a core that ORT's worker then
waits for. Two ways out: torch single-threaded between the products (what lorad did, leaving a core idle through a
third of the step), or idle OpenMP workers that sleep at once (``OMP_WAIT_POLICY=PASSIVE``), which libgomp (and LLVM's
libomp, which some torch builds carry) reads once, as it loads with torch. Measured on a 2-core AVX2 EPYC (SmolLM2,
auto plan on ort-cpu fp32, 10 steps, 7 timed, one process per run, alternating):

| torch threads, wait policy | quiet host: tok/s | cores busy | both cores taken by two other processes: tok/s |
|---|---|---|---|
| 1, libgomp's default | 68.0-78.5 | 1.56 | 43.8 |
| 2, passive | 79.1-84.9 | 1.77-1.80 | 42.2 |
| 2, ``GOMP_SPINCOUNT=10000`` | 81.5-87.1 | 1.89 | 33.7 |
| 2, libgomp's default | 57.8 | 1.94 | 15.2 |

Passive gains on a quiet host and holds its own on a busy one, where the spinning variants lose, so a process that
will train on such a backend asks for it before torch loads (``prefer_sleeping_workers``: the daemon as it decides its
backend, the benchmark's workers), and the model then trains with torch on every core (``torch_threads_for``).
Backends whose products run on torch's own workers (torch itself, where spinning pays: torch fp32 training here ran
5-12 % slower with passive workers) or on an NPU keep libgomp's default. A user's own ``OMP_WAIT_POLICY`` is left
alone and decides.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from lorad.kernels.capabilities import capability

WAIT_POLICY = "OMP_WAIT_POLICY"


def prefer_sleeping_workers(backend: str, environ: MutableMapping[str, str] | None = None) -> bool:
    """Before torch loads, asks libgomp to put idle workers to sleep at once when ``backend`` runs its products on a
    pool of its own (``Capability.own_cpu_pool``); returns whether torch's idle workers sleep in this process.

    Leaves a policy already in ``environ`` (default ``os.environ``) alone, and changes nothing once torch is loaded:
    libgomp read the environment then. Child processes inherit the setting.
    """
    env = os.environ if environ is None else environ
    if capability(backend).own_cpu_pool and WAIT_POLICY not in env and not torch_loaded():
        env[WAIT_POLICY] = "PASSIVE"
    return workers_sleep(env)


def torch_loaded() -> bool:
    """Whether torch (and with it libgomp, which reads its environment once, as it loads) is loaded already."""
    return "torch" in sys.modules


def workers_sleep(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether torch's idle OpenMP workers sleep at once in this process: ``OMP_WAIT_POLICY`` says passive. (A policy
    put into ``os.environ`` after torch loaded would be believed but not in effect; ``prefer_sleeping_workers`` never
    does that.)"""
    env = os.environ if environ is None else environ
    return env.get(WAIT_POLICY, "").strip().lower() == "passive"


def torch_threads_for(backend: str, environ: MutableMapping[str, str] | None = None) -> int:
    """torch's intra-op threads while a model on ``backend`` trains or evaluates: 0 (torch's own count, every core)
    unless the backend has a pool of its own and torch's idle workers spin, then 1 (see the module docstring)."""
    return 1 if capability(backend).own_cpu_pool and not workers_sleep(environ) else 0
