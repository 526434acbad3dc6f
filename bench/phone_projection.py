"""Phone performance model: projected LoRA step time and tokens/s on Snapdragon phones, NPU schedule vs CPU only.

PROJECTION, NOT A MEASUREMENT. Nothing here ran on a phone. The model combines published device figures and
estimates (each printed with its source and marked PUBLISHED / DERIVED / ESTIMATE) with CPU cost ratios measured
on this host at run time (marked MEASURED).

Schedules:
- lorad (NPU): every frozen product (forward x·Wᵀ and input gradient dy·W, lm_head included) is one QNN call per
  token bucket on the NPU; the LoRA terms of the same linear run on the CPU at the same time, so each linear costs
  max(NPU call, CPU LoRA). Attention, norms/RoPE/SwiGLU, the chunked loss and what the NPU waits for are serial CPU
  work; the AdamW step of a layer overlaps the backward of earlier layers (only the last layer's share is exposed).
- CPU only: the same step with the frozen products as fp32 matmuls on the phone CPU, nothing overlapped.

Usage: python bench/phone_projection.py [--tokens 256] [--rank 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """Decoder shapes from the model's Hugging Face config.json (PUBLISHED)."""

    name: str
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    source: str

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of the frozen linears of one layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, f = self.hidden, self.inter
        return [("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h), ("gate", h, f), ("up", h, f), ("down", f, h)]


MODELS = {
    "SmolLM2-135M": Shape("SmolLM2-135M", 576, 1536, 30, 9, 3, 64, 49152, "HuggingFaceTB/SmolLM2-135M config.json"),
    "Qwen2.5-0.5B": Shape("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 64, 151936, "Qwen/Qwen2.5-0.5B config.json"),
    "Qwen3-1.7B": Shape("Qwen3-1.7B", 2048, 6144, 28, 16, 8, 128, 151936, "Qwen/Qwen3-1.7B config.json"),
}


@dataclass(frozen=True)
class Figure:
    """One device assumption: value, unit, kind (PUBLISHED / DERIVED / ESTIMATE) and where it comes from."""

    value: float
    unit: str
    kind: str
    source: str


# Device profiles. TOPS figures are vendor marketing peaks (precision not always stated); sustained fractions are
# ESTIMATES because no public per-op HTP GEMM benchmark for these shapes was found.
DEVICES: dict[str, dict[str, Figure]] = {
    "Snapdragon 8 Gen 3 (SM8650, HTP v75)": {
        "npu_int8_tops": Figure(45.0, "TOPS", "PUBLISHED", "Qualcomm Hexagon NPU marketing peak for 8 Gen 3 (INT8)"),
        "npu_fp16_ratio": Figure(0.5, "x INT8", "ESTIMATE", "HMX FP16 at half the INT8 MAC rate (assumed)"),
        "npu_util": Figure(0.30, "of peak", "ESTIMATE", "sustained QNN GEMM utilisation at M=256 (assumed)"),
        "dram_gbs": Figure(76.8, "GB/s", "PUBLISHED", "LPDDR5X-9600 (4800 MHz), 64-bit: 9.6 GT/s x 8 B"),
        "npu_dram_share": Figure(0.6, "of DRAM", "ESTIMATE", "bandwidth the NPU reaches while streaming weights"),
        "call_overhead_us": Figure(150.0, "us/call", "ESTIMATE", "QNN graph execute + FastRPC round trip"),
        "cpu_gflops": Figure(
            120.0, "GFLOP/s", "DERIVED", "X4@3.3+5xA720@3.0+2xA520 NEON FMA peak ~340 x0.35 sustained (est.)"
        ),
        "cpu_gbs": Figure(40.0, "GB/s", "ESTIMATE", "multi-core STREAM-like bandwidth on the CPU cluster"),
    },
    "Snapdragon 8 Elite (SM8750, HTP v79)": {
        "npu_int8_tops": Figure(65.0, "TOPS", "DERIVED", "8 Gen 3's 45 TOPS x Qualcomm's '45% faster NPU' claim"),
        "npu_fp16_ratio": Figure(0.5, "x INT8", "ESTIMATE", "HMX FP16 at half the INT8 MAC rate (assumed)"),
        "npu_util": Figure(0.30, "of peak", "ESTIMATE", "sustained QNN GEMM utilisation at M=256 (assumed)"),
        "dram_gbs": Figure(84.8, "GB/s", "PUBLISHED", "LPDDR5X-10600 (5300 MHz), 64-bit: 10.6 GT/s x 8 B"),
        "npu_dram_share": Figure(0.6, "of DRAM", "ESTIMATE", "bandwidth the NPU reaches while streaming weights"),
        "call_overhead_us": Figure(150.0, "us/call", "ESTIMATE", "QNN graph execute + FastRPC round trip"),
        "cpu_gflops": Figure(
            280.0, "GFLOP/s", "DERIVED", "2xOryon@4.32+6x@3.53 GHz 4x128b FMA ~950 peak x0.3 sustained (est.)"
        ),
        "cpu_gbs": Figure(55.0, "GB/s", "ESTIMATE", "multi-core STREAM-like bandwidth on the CPU cluster"),
    },
}

# Published on-device fine-tuning figures to compare with (not produced by lorad).
PUBLISHED = [
    {
        "what": "Qwen3-1.7B LoRA, Snapdragon 8 Elite Adreno GPU, llama.cpp-based trainer (QVAC Fabric LLM)",
        "tokens_per_s": 6.0,
        "kind": "PUBLISHED (figure as quoted in lorad issue 7; not re-verified here)",
        "source": "https://huggingface.co/blog/qvac/fabric-llm-finetune",
    },
    {
        "what": "BitNet-1B LoRA, ~18k tokens in 1 h 18 min on a Galaxy S25 (8 Elite, Adreno GPU)",
        "tokens_per_s": round(18000 / (78 * 60), 1),
        "kind": "DERIVED from the published duration (epoch count not stated)",
        "source": "https://huggingface.co/blog/qvac/fabric-llm-finetune-bitnet",
    },
]

NPU_PRECISIONS = {"fp16": (2.0, "fp16"), "w8a16": (1.0, "fp16"), "w8a8": (1.0, "int8")}


def _time(fn: Callable[[], object], reps: int, trials: int = 3) -> float:
    """Seconds per call: the best of ``trials`` averages over ``reps`` calls (other load on the host only adds time)."""
    fn()
    best = math.inf
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _ratio(fn_a: Callable[[], object], fn_b: Callable[[], object], reps: int, trials: int = 5) -> float:
    """Median over ``trials`` of time(fn_a) / time(fn_b), each pair measured back to back.

    Other agents share this host; a ratio of two timings taken under the same load is far steadier than either.
    """
    ratios = sorted(_time(fn_a, reps, trials=1) / _time(fn_b, reps, trials=1) for _ in range(trials))
    return ratios[len(ratios) // 2]


def calibrate(shape: Shape, tokens: int, rank: int) -> dict[str, float]:
    """MEASURED on this host: how much slower the CPU-side work runs than its ideal, as ratios.

    - ``lora_eff``: GFLOP/s of the rank-r LoRA products relative to a large GEMM of the same layer.
    - ``attn_eff``: GFLOP/s of one layer's attention (QKᵀ, softmax, PV) relative to the same GEMM.
    - ``elementwise_slowdown``: time of RMSNorm + SwiGLU + residual (forward and backward, eager autograd) over
      the time of a plain copy moving the same bytes; the phone's time is this x bytes / phone GB/s.
    """
    torch.manual_seed(0)
    h, f, t = shape.hidden, shape.inter, tokens
    x, w = torch.randn(t, h), torch.randn(f, h)
    big_flops = 2 * t * h * f

    def gemm() -> object:
        return x @ w.t()

    big = _time(gemm, 5)
    a, b = torch.randn(rank, h), torch.randn(f, rank)
    lora_slow = _ratio(lambda: (x @ a.t()) @ b.t(), gemm, 10)
    lora_eff = (2 * t * rank * (h + f) / big_flops) / lora_slow
    q = torch.randn(1, shape.heads, t, shape.head_dim)
    attn_slow = _ratio(lambda: torch.softmax(q @ q.transpose(-1, -2), -1) @ q, gemm, 5)
    attn_eff = (4 * shape.heads * t * t * shape.head_dim / big_flops) / attn_slow
    xs = torch.randn(t, h, requires_grad=True)
    g, u = torch.randn(t, f, requires_grad=True), torch.randn(t, f, requires_grad=True)

    def elementwise() -> None:
        n = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6)
        y = torch.nn.functional.silu(g) * u
        (n.sum() + y.sum() + (xs + n).sum()).backward()

    ew_bytes = 4 * (12 * t * h + 10 * t * f)  # fp32 bytes touched, counted from the ops above (fwd + bwd)
    src = torch.randn(ew_bytes // 8)  # a copy moves 8 bytes per fp32 element (read + write)
    dst = torch.empty_like(src)
    ew_slow = _ratio(elementwise, lambda: dst.copy_(src), 5)
    return {
        "gemm_gflops": big_flops / big / 1e9,
        "lora_eff": lora_eff,
        "attn_eff": attn_eff,
        "elementwise_bytes_per_layer": float(ew_bytes),
        "elementwise_slowdown": ew_slow,
    }


# The pessimistic case scales these ESTIMATES (a third of the NPU utilisation, triple call overhead, half the CPU).
PESSIMISTIC = {"npu_util": 1 / 3, "call_overhead_us": 3.0, "cpu_gflops": 0.5, "cpu_gbs": 0.5}


def project(
    shape: Shape,
    dev: dict[str, Figure],
    cal: dict[str, float],
    tokens: int,
    rank: int,
    prec: str,
    scale: dict[str, float] | None = None,
) -> dict:
    """Projected step time for one micro-batch of ``tokens`` tokens (one token bucket) under both schedules."""
    v = {k: fig.value * (scale or {}).get(k, 1.0) for k, fig in dev.items()}
    w_bytes, npu_kind = NPU_PRECISIONS[prec]
    peak = v["npu_int8_tops"] * 1e12 * (v["npu_fp16_ratio"] if npu_kind == "fp16" else 1.0)
    npu_flops = peak * v["npu_util"]
    npu_bw = v["dram_gbs"] * 1e9 * v["npu_dram_share"]
    cpu = v["cpu_gflops"] * 1e9
    lora_rate, attn_rate = cpu * cal["lora_eff"], cpu * cal["attn_eff"]
    # Elementwise work (eager torch: memory traffic + per-op overhead): its bytes at the phone CPU's bandwidth,
    # times the slowdown over a plain copy measured on this host.
    ew_layer = cal["elementwise_slowdown"] * cal["elementwise_bytes_per_layer"] / (v["cpu_gbs"] * 1e9)
    overhead = v["call_overhead_us"] * 1e-6
    t, L = tokens, shape.layers

    def npu_call(k: int, n: int) -> float:
        flops = 2 * t * k * n
        bytes_ = k * n * w_bytes + 2 * t * (k + n)  # weights streamed from DRAM + fp16 activations in/out
        return max(flops / npu_flops, bytes_ / npu_bw) + overhead

    npu_total = cpu_lora_total = lorad_linear = cpu_frozen = 0.0
    lora_params = 0
    for _, k, n in shape.linears():
        for _direction in ("fwd", "bwd"):
            call = npu_call(k, n) if _direction == "fwd" else npu_call(n, k)
            # LoRA: fwd 2r(k+n) FLOP/token; bwd dA, dB, dX share: 4r(k+n).
            lflops = (2 if _direction == "fwd" else 4) * rank * (k + n) * t
            lt = lflops / lora_rate
            npu_total += call * L
            cpu_lora_total += lt * L
            lorad_linear += max(call, lt) * L
            cpu_frozen += 2 * t * k * n / cpu * L
        lora_params += rank * (k + n) * L
    head_call = npu_call(shape.hidden, shape.vocab) + npu_call(shape.vocab, shape.hidden)
    head_cpu = 2 * (2 * t * shape.hidden * shape.vocab) / cpu
    q_dim = shape.heads * shape.head_dim
    attn = 12 * t * t * q_dim * L / attn_rate  # fwd 4·T²·d (QKᵀ, PV) + bwd 8·T²·d, full (masked, not skipped)
    loss = 4 * 4 * t * shape.vocab / (v["cpu_gbs"] * 1e9)  # chunked CE: ~4 fp32 passes over the logits
    serial_cpu = attn + ew_layer * L + loss
    adam = 28 * lora_params / (v["cpu_gbs"] * 1e9)  # AdamW: read p,g,m,v + write p,m,v, fp32 (bytes/param)
    lorad_step = lorad_linear + head_call + serial_cpu + adam / L
    cpu_step = cpu_frozen + head_cpu + cpu_lora_total + serial_cpu + adam
    frozen_params = sum(k * n for _, k, n in shape.linears()) * L + shape.hidden * shape.vocab
    return {
        "model": shape.name,
        "precision": prec,
        "tokens_per_step": t,
        "lorad_step_s": lorad_step,
        "lorad_tokens_per_s": t / lorad_step,
        "cpu_only_step_s": cpu_step,
        "cpu_only_tokens_per_s": t / cpu_step,
        "speedup": cpu_step / lorad_step,
        "npu_busy_s": npu_total + head_call,
        "cpu_lora_s": cpu_lora_total,
        "cpu_serial_s": serial_cpu,
        "npu_calls_per_step": (7 * L + 1) * 2,
        "bottleneck": "NPU" if npu_total >= cpu_lora_total else "CPU LoRA",
        # Two stored copies (forward and input-gradient graphs; docs/qnn_htp.md §1) of every frozen weight.
        "npu_weight_gib": 2 * frozen_params * w_bytes / 2**30,
        "lora_params": lora_params,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch = the NPU token bucket")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank on all 7 linears of every layer")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for host calibration (1: steadiest ratios)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    print("PROJECTION — not measured on a phone. Assumptions:")
    for dname, dev in DEVICES.items():
        print(f"  {dname}")
        for key, fig in dev.items():
            print(f"    {key:18s} {fig.value:>8g} {fig.unit:9s} [{fig.kind}] {fig.source}")
    for s in MODELS.values():
        print(
            f"  model {s.name}: hidden {s.hidden}, ffn {s.inter}, layers {s.layers}, heads {s.heads}/{s.kv_heads}, "
            f"head_dim {s.head_dim}, vocab {s.vocab} [PUBLISHED] {s.source}"
        )
    print(f"  pessimistic case scales the estimates by {PESSIMISTIC}")
    print(f"  schedule: {args.tokens} tokens per step (one bucket), LoRA rank {args.rank} on q,k,v,o,gate,up,down")

    results, cals = [], {}
    for s in MODELS.values():
        cal = calibrate(s, args.tokens, args.rank)
        cals[s.name] = cal
        print(
            f"  host calibration [MEASURED, {args.threads} threads] {s.name}: GEMM {cal['gemm_gflops']:.0f} GFLOP/s, "
            f"LoRA eff {cal['lora_eff']:.2f}, attention eff {cal['attn_eff']:.2f} (of GEMM GFLOP/s), "
            f"elementwise {cal['elementwise_slowdown']:.1f}x a plain copy of its "
            f"{cal['elementwise_bytes_per_layer'] / 2**20:.0f} MiB/layer"
        )
        for dname, dev in DEVICES.items():
            for prec in NPU_PRECISIONS:
                r = project(s, dev, cal, args.tokens, args.rank, prec)
                low = project(s, dev, cal, args.tokens, args.rank, prec, PESSIMISTIC)
                r["device"] = dname
                r["lorad_tokens_per_s_pessimistic"] = low["lorad_tokens_per_s"]
                r["cpu_only_tokens_per_s_pessimistic"] = low["cpu_only_tokens_per_s"]
                results.append(r)

    hdr = (
        f"{'model':14s} {'device':38s} {'npu prec':8s} {'lorad s/step':>12s} {'lorad tok/s':>11s} "
        f"{'(pessim.)':>9s} {'CPU-only tok/s':>14s} {'(pessim.)':>9s} {'x':>5s} {'bound':>8s} {'NPU GiB':>7s}"
    )
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in results:
        print(
            f"{r['model']:14s} {r['device']:38s} {r['precision']:8s} {r['lorad_step_s']:12.3f} "
            f"{r['lorad_tokens_per_s']:11.0f} {r['lorad_tokens_per_s_pessimistic']:9.0f} "
            f"{r['cpu_only_tokens_per_s']:14.0f} {r['cpu_only_tokens_per_s_pessimistic']:9.0f} {r['speedup']:5.1f} "
            f"{r['bottleneck']:>8s} {r['npu_weight_gib']:7.2f}"
        )
    print("\nPublished on-device fine-tuning figures (other systems, for scale):")
    for p in PUBLISHED:
        print(f"  {p['tokens_per_s']:>5g} tok/s  {p['what']}  [{p['kind']}] {p['source']}")
    q3 = [r for r in results if r["model"] == "Qwen3-1.7B" and "Elite" in r["device"] and r["precision"] == "fp16"]
    if q3:
        r = q3[0]
        print(
            f"  lorad projection, Qwen3-1.7B fp16 on the 8 Elite NPU: {r['lorad_tokens_per_s']:.0f} tok/s "
            f"({r['lorad_tokens_per_s_pessimistic']:.0f} pessimistic), i.e. "
            f"x{r['lorad_tokens_per_s_pessimistic'] / PUBLISHED[0]['tokens_per_s']:.0f}-"
            f"x{r['lorad_tokens_per_s'] / PUBLISHED[0]['tokens_per_s']:.0f} the published GPU figure. A projection "
            "from estimates, not a measurement: thermal throttling over a long run, Python overhead on the phone "
            "and QNN behaviour on a real HTP are not modelled."
        )
    if any(r["npu_weight_gib"] > 6 for r in results):
        print(
            "  note: 'NPU GiB' counts two copies per weight (fwd + bwd graphs); above ~6 GiB a 12-16 GB phone "
            "needs w8a16 or the single-copy weight-as-input form."
        )
    if args.json:
        out = {
            "projection": True,
            "tokens_per_step": args.tokens,
            "rank": args.rank,
            "assumptions": {d: {k: asdict(f) for k, f in dev.items()} for d, dev in DEVICES.items()},
            "pessimistic_scale": PESSIMISTIC,
            "host_calibration": cals,
            "results": results,
            "published": PUBLISHED,
        }
        print(json.dumps(out, default=lambda o: round(o, 6) if isinstance(o, float) else str(o)))
    return 0 if all(math.isfinite(r["lorad_step_s"]) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
