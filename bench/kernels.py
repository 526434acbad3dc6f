"""Frozen-linear kernel benchmark: fwd and input-grad time per backend/precision vs torch fp32, weight bytes.

Usage: python bench/kernels.py [--models smollm2-135m,qwen2.5-0.5b] [--tokens 256] [--repeats 5] [--json]
       [--htp] [--htp-repeats 1] [--no-lm-head]
torch fp32 is measured in the same run as the baseline; ``ratio`` = torch-fp32 time / this time (higher = faster).
qnn-htp runs only with --htp (x86 simulator, ~5 GFLOP/s) and compares the dynamic-weight and static forms.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from lorad.kernels import make_frozen_linear

# (name, out, in, bias, count per model) for one decoder layer, plus the lm_head; count = layers for block linears.
MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "layers": 30,
        "linears": [
            ("q_proj", 576, 576, False), ("k_proj", 192, 576, False), ("v_proj", 192, 576, False),
            ("o_proj", 576, 576, False), ("gate_proj", 1536, 576, False), ("up_proj", 1536, 576, False),
            ("down_proj", 576, 1536, False),
        ],
        "lm_head": (49152, 576),
    },
    "qwen2.5-0.5b": {
        "layers": 24,
        "linears": [
            ("q_proj", 896, 896, True), ("k_proj", 128, 896, True), ("v_proj", 128, 896, True),
            ("o_proj", 896, 896, False), ("gate_proj", 4864, 896, False), ("up_proj", 4864, 896, False),
            ("down_proj", 896, 4864, False),
        ],
        "lm_head": (151936, 896),
    },
}  # fmt: skip
# ort-cpu w8a8 form = activation scale granularity: "row" (per token, the default) or "tensor" (one per call).
CPU_CASES = [
    ("torch", "fp32"), ("ort-cpu", "fp32"), ("ort-cpu", "w8a8", "row"), ("ort-cpu", "w8a8", "tensor"),
    ("torch", "fp16"), ("torch", "bf16"), ("torch", "w8a8"),
]  # fmt: skip
HTP_CASES = [("qnn-htp", "fp16", "dynamic"), ("qnn-htp", "fp16", "static"), ("qnn-htp", "w8a16", "static")]


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (and lazy session build)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _build(backend: str, precision: str, form: str | None, w: torch.Tensor, b: torch.Tensor | None, t: int) -> Any:
    if backend == "qnn-htp":
        from lorad.kernels.qnn_htp import QnnFrozenLinear

        return QnnFrozenLinear(w, b, precision=precision, precision_bwd=precision, name="bench", cache_dir=None,
                               model_hash="", buckets=(t,), form=form)  # fmt: skip
    if backend == "ort-cpu" and form:
        from lorad.kernels.ort_cpu import OrtCpuFrozenLinear

        return OrtCpuFrozenLinear(w, b, precision=precision, precision_bwd=precision, name="bench", act_quant=form)
    return make_frozen_linear(w, b, backend=backend, precision=precision)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def bench_shape(out_f: int, in_f: int, bias: bool, t: int, cases: list[tuple], repeats: int) -> list[dict[str, Any]]:
    """Time every case on one [out, in] weight; the first case must be torch fp32 (the baseline)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_f, in_f, generator=g) * 0.02
    b = torch.randn(out_f, generator=g) * 0.02 if bias else None
    x, dy = torch.randn(t, in_f, generator=g), torch.randn(t, out_f, generator=g) * 1e-3
    ref_y, ref_dx = x @ w.t() + (0 if b is None else b), dy @ w
    # Real activations and gradients differ per token by orders of magnitude (attention-sink tokens, unlabelled
    # positions): the "skew" inputs scale each row by exp(N(0, 1.5²)) to show what the activation-scale
    # granularity costs there.
    skew = torch.exp(torch.randn(t, 1, generator=g) * 1.5)
    xs, dys = x * skew, dy * skew
    ref_ys, ref_dxs = xs @ w.t() + (0 if b is None else b), dys @ w
    rows: list[dict[str, Any]] = []
    for case in cases:
        backend, precision = case[0], case[1]
        form = case[2] if len(case) > 2 else None
        t0 = time.perf_counter()
        fl = _build(backend, precision, form, w, b, t)
        build_s = time.perf_counter() - t0
        reps = case[3] if len(case) > 3 else repeats
        fwd = _median_ms(lambda fl=fl: fl.forward(x), reps)
        bwd = _median_ms(lambda fl=fl: fl.input_grad(dy), reps)
        y, dx = fl.forward(x), fl.input_grad(dy)
        rows.append({
            "backend": backend, "precision": precision, "form": form or "", "fwd_ms": fwd, "bwd_ms": bwd,
            "weight_bytes": int(fl.nbytes), "build_s": build_s,
            "rel_err_fwd": _rel(y, ref_y), "rel_err_bwd": _rel(dx, ref_dx),
            "rel_err_fwd_skew": _rel(fl.forward(xs), ref_ys), "rel_err_bwd_skew": _rel(fl.input_grad(dys), ref_dxs),
        })  # fmt: skip
        del fl
        gc.collect()
    base = rows[0]
    for r in rows:
        r["ratio_fwd"] = base["fwd_ms"] / r["fwd_ms"]
        r["ratio_bwd"] = base["bwd_ms"] / r["bwd_ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", type=int, default=256, help="token bucket (rows per call)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--htp", action="store_true", help="also run qnn-htp (slow on the x86 simulator)")
    ap.add_argument("--htp-repeats", type=int, default=1)
    ap.add_argument("--no-lm-head", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    # The host is shared; load average tells a reader whether contention inflated the numbers.
    result: dict[str, Any] = {"tokens": args.tokens, "threads": threads, "torch": torch.__version__,
                              "loadavg_start": os.getloadavg()[0], "models": {}}  # fmt: skip
    for model in args.models.split(","):
        spec = MODELS[model]
        shapes = [(n, o, i, bb, spec["layers"]) for n, o, i, bb in spec["linears"]]
        if not args.no_lm_head:
            shapes.append(("lm_head", *spec["lm_head"], False, 1))
        per_shape = {}
        totals: dict[str, dict[str, float]] = {}
        for name, o, i, bias, count in shapes:
            cases: list[tuple] = list(CPU_CASES)
            if args.htp and (name != "lm_head"):
                cases += [(*c, args.htp_repeats) for c in HTP_CASES]
            rows = bench_shape(o, i, bias, args.tokens, cases, args.repeats)
            per_shape[name] = {"out": o, "in": i, "bias": bias, "count": count, "rows": rows}
            for r in rows:
                key = f"{r['backend']}/{r['precision']}" + (f"/{r['form']}" if r["form"] else "")
                tot = totals.setdefault(key, {"fwd_ms": 0.0, "bwd_ms": 0.0, "weight_bytes": 0, "shapes": 0})
                tot["fwd_ms"] += count * r["fwd_ms"]
                tot["bwd_ms"] += count * r["bwd_ms"]
                tot["weight_bytes"] += count * r["weight_bytes"]
                tot["shapes"] += 1
            _print_rows(model, name, o, i, rows)
        full = {k: v for k, v in totals.items() if v["shapes"] == len(shapes)}
        base = full.get("torch/fp32")
        for v in full.values():
            step = v["fwd_ms"] + v["bwd_ms"]
            v["step_ms"] = step
            v["frozen_tokens_per_s"] = args.tokens / (step / 1e3)
            v["ratio"] = (base["fwd_ms"] + base["bwd_ms"]) / step if base else float("nan")
            del v["shapes"]
        result["models"][model] = {"shapes": per_shape, "totals": full}
        print(f"\n{model}: all frozen linears, one {args.tokens}-token fwd + input-grad (lm_head incl.: "
              f"{not args.no_lm_head})")  # fmt: skip
        for k, v in full.items():
            print(f"  {k:<18} step {v['step_ms']:9.1f} ms  {v['frozen_tokens_per_s']:9.0f} tok/s  "
                  f"x{v['ratio']:.2f} vs torch fp32  weights {v['weight_bytes'] / 2**20:8.1f} MiB")  # fmt: skip
        sys.stdout.flush()
    result["loadavg_end"] = os.getloadavg()[0]
    print(f"\nload average: start {result['loadavg_start']:.2f}, end {result['loadavg_end']:.2f} ({threads} cores)")
    if args.json:
        print(json.dumps(result))
    return 0


def _print_rows(model: str, name: str, o: int, i: int, rows: list[dict[str, Any]]) -> None:
    print(f"\n{model} {name} [{o}x{i}]")
    cols = ("fwd ms", "x", "bwd ms", "x", "MiB", "rel fwd", "rel bwd", "skew fwd", "skew bwd")
    widths = (9, 6, 9, 6, 8, 9, 9, 9, 9)
    print(f"  {'backend/precision':<26} " + " ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        k = f"{r['backend']}/{r['precision']}" + (f"/{r['form']}" if r["form"] else "")
        print(f"  {k:<26} {r['fwd_ms']:9.2f} {r['ratio_fwd']:6.2f} {r['bwd_ms']:9.2f} {r['ratio_bwd']:6.2f} "
              f"{r['weight_bytes'] / 2**20:8.2f} {r['rel_err_fwd']:9.2e} {r['rel_err_bwd']:9.2e} "
              f"{r['rel_err_fwd_skew']:9.2e} {r['rel_err_bwd_skew']:9.2e}")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
