"""The fused CPU kernels (kernels/fused_cpu.cpp) against the torch ops they replace, at SmolLM2's shapes, in one run.

Each row times a kernel through its Python entry point and, as its baseline, what the training step runs where the
kernels are off (``fused.disabled()``; for attention, torch's ``scaled_dot_product_attention``; for the passes that
have no torch twin, the thin products they replace), on the same operands: median microseconds of ``--repeats``
rounds of ``--calls`` calls, torch's intra-op threads as set.

    .venv/bin/python bench/fused.py                 # T = 214 rows (the benchmark's mean packed length), 2 threads
    .venv/bin/python bench/fused.py --rows 256 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lorad.kernels import fused

HIDDEN, INTERMEDIATE, RANK = 576, 1536, 8  # SmolLM2-135M, r = 8 on every projection


def _us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def cases(t: int) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """(name, kernel call, baseline call) at T = ``t`` rows."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    x, w, gate, up, d = r(t, HIDDEN), r(HIDDEN), r(t, INTERMEDIATE), r(t, INTERMEDIATE), r(t, INTERMEDIATE)
    a_qkv, a_gu, a_down = r(3 * RANK, HIDDEN), r(2 * RANK, HIDDEN), r(RANK, INTERMEDIATE)
    h, b, prod = r(t, RANK), r(INTERMEDIATE, RANK), r(t, INTERMEDIATE).to(torch.bfloat16)
    _, _, rstd = fused.rms_norm_forward(x, w, 1e-5)
    g_qkv = r(t, 3 * RANK)
    xb = x.to(torch.bfloat16)
    q, cos, sin = r(1, t, 9, 64), r(t, 64), r(t, 64)  # SmolLM2's q: 9 heads of 64
    dq = r(1, 9, t, 64)
    qa, ka, va, da = r(1, 9, t, 64), r(1, 3, t, 64), r(1, 3, t, 64), r(1, t, 9 * 64)  # 3 KV heads

    scale = 64**-0.5

    def sdpa() -> torch.Tensor:  # the rows o_proj took from torch's attention
        y = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(1, t, -1)

    def sdpa_grads() -> Any:
        qs, ks, vs = (x.clone().requires_grad_() for x in (qa, ka, va))
        y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(y.transpose(1, 2).reshape(1, t, -1), (qs, ks, vs), da)

    def attn_grads() -> Any:  # the kernels' two directions, as the autograd node calls them
        _, lse = fused.causal_attention_f32_forward(qa, ka, va, scale)
        return fused.causal_attention_f32_backward(da, qa, ka, va, lse, scale=scale)

    def off(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with fused.disabled():
                return fn()

        return run

    def both(name: str, fn: Callable[[], Any]) -> tuple[str, Callable[[], Any], Callable[[], Any]]:
        return name, fn, off(fn)

    return [
        both("rms_norm_forward [T, 576]", lambda: fused.rms_norm_forward(x, w, 1e-5)),
        both("swiglu_forward [T, 1536]", lambda: fused.swiglu_forward(gate, up)),
        both("swiglu_backward [T, 1536]", lambda: fused.swiglu_backward(d, gate, up)),
        both("rope_forward fp32 q [1, T, 9, 64]", lambda: fused.rope_forward(q, cos, sin, bf16=False)),
        both("rope_backward fp32 q", lambda: fused.rope_backward(dq, cos, sin)),
        ("attention fp32 forward [1, 9, T, 64]", lambda: fused.causal_attention_f32_forward(qa, ka, va, scale), sdpa),
        ("attention fp32 forward + backward", attn_grads, sdpa_grads),
        both("lowrank_rows q/k/v [T, 576] k=24", lambda: fused.lowrank_rows(x, a_qkv)),
        both("lowrank_rows gate/up [T, 576] k=16", lambda: fused.lowrank_rows(x, a_gu)),
        both("lowrank_rows down [T, 1536] k=8", lambda: fused.lowrank_rows(d, a_down)),
        both("widen_lowrank [T, 1536] r=8", lambda: fused.widen_lowrank(prod, h, b.t(), scaling=2.0)),
        (  # the baselines of the passes without a torch twin: the thin products they replace
            "lora_out_grads [T, 1536] r=8",
            lambda: fused.lora_out_grads([d], h, [b], scaling=2.0, want_bf16=False),
            lambda: ((b.t() @ d.t()).t(), (h.t() @ d).t().mul_(2.0)),
        ),
        (
            "rms_norm_a_grads [T, 576] k=24",
            lambda: fused.rms_norm_a_grads(x, rstd, w, g_qkv, scaling=2.0),
            lambda: (g_qkv.t() @ fused.rms_norm_apply(x, rstd, w)).mul_(2.0),
        ),
        (  # o_proj's dA from the bf16 attention rows: the thin product over their widened copy
            "lowrank_a_grads bf16 rows [T, 576] r=8",
            lambda: fused.lowrank_a_grads(xb, h, scaling=2.0),
            lambda: (h.t() @ xb.float()).mul_(2.0),
        ),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=214, help="T, rows per call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if fused.kernels() is None:
        print(f"the fused kernels do not run here: {fused.describe()[1]}")
        return 1
    print(f"fused kernels: {fused.describe()[1]}; T = {a.rows}, {a.threads} threads, median of {a.repeats} x {a.calls}")
    print(f"{'kernel':36s} {'fused us':>9s} {'torch us':>9s} {'speedup':>8s}")
    for name, kern, base in cases(a.rows):
        k_us, b_us = _us(kern, a.calls, a.repeats), _us(base, a.calls, a.repeats)
        print(f"{name:36s} {k_us:9.1f} {b_us:9.1f} {b_us / k_us:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
