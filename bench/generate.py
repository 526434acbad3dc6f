"""Generation speed of the daemon's base model (SmolLM2-135M-Instruct, real weights), ms a generated token.

Usage: python bench/generate.py [--tokens 64] [--rounds 3] [--threads 2] [--json]

Three systems, measured in the same run, round-robin within each round (greedy, one chat prompt, the KV cache):
- ``fp32``: the precision the daemon generated at before (its training reference);
- ``bf16 oneDNN``: bf16 weights through oneDNN's GEMM (``fused.small_rows_bf16`` off);
- ``bf16`` (the daemon's ``Capability.generation()`` where the CPU has bf16 dot products): the small-rows kernel.
Printed: median ms a token after the first (decode), the prompt's time, and how many of the greedy tokens each system
shares with fp32's (bf16 rounding may change a near-tie). Generation runs as the daemon's Generate does (``generate``:
text decoded as it goes, a stop token ends it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lorad.kernels import fused
from lorad.server.engine.api import SamplingConfig, generate, load_model, resolve, resolve_backend

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Tell me a short story about a baker who plants tomatoes at night."


def _run(loaded: Any, ids: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """(prompt seconds, median decode seconds a token, the generated ids) of one greedy generation, as the daemon's
    Generate runs it (text decoded as it goes; a stop token ends it early)."""
    cfg = SamplingConfig(max_new_tokens=tokens)
    stamps, out = [time.perf_counter()], []
    for t in generate(loaded.model, loaded.tokenizer, ids, cfg, adapter=None):
        stamps.append(time.perf_counter())
        out.append(t.id)
    steps = [b - a for a, b in itertools.pairwise(stamps[1:])]
    return stamps[1] - stamps[0], statistics.median(steps), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "lorad"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    backend = resolve_backend("auto").name
    cache = Path(a.cache)
    models = {p: load_model(None, cache_root=cache, backend=backend, precision=p, lora=None) for p in ("fp32", "bf16")}
    tok = models["fp32"].tokenizer
    ids = list(tok.render_chat([{"role": "user", "content": PROMPT}], add_generation_prompt=True)[0])
    systems = {"fp32": ("fp32", fused.SMALL_ROWS), "bf16 oneDNN": ("bf16", 0), "bf16": ("bf16", fused.SMALL_ROWS)}
    got: dict[str, dict[str, list[Any]]] = {s: {"prompt": [], "token": [], "ids": []} for s in systems}
    small = fused.SMALL_ROWS
    try:
        _run(models["bf16"], ids, 4)  # warm-up: kernels loaded, first-call costs paid
        _run(models["fp32"], ids, 4)
        for r in range(a.rounds):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for s in order:
                prec, fused.SMALL_ROWS = systems[s]
                p, t, out = _run(models[prec], ids, a.tokens)
                got[s]["prompt"].append(p)
                got[s]["token"].append(t)
                got[s]["ids"] = out
    finally:
        fused.SMALL_ROWS = small
    ref = got["fp32"]["ids"]
    rows = []
    for s in systems:
        tok_ms = 1e3 * statistics.median(got[s]["token"])
        same = next((i for i, (x, y) in enumerate(zip(got[s]["ids"], ref, strict=False)) if x != y), len(ref))
        rows.append(
            {
                "system": s,
                "ms_per_token": tok_ms,
                "tokens_per_s": 1e3 / tok_ms,
                "prompt_ms": 1e3 * statistics.median(got[s]["prompt"]),
                "prompt_tokens": len(ids),
                "tokens_same_as_fp32": same,
                "by_round_ms": [round(1e3 * x, 2) for x in got[s]["token"]],
            }
        )
    base = rows[0]["ms_per_token"]
    kernels_on = fused.describe()[0]
    print(f"SmolLM2-135M-Instruct on {backend}, {a.threads} threads, greedy, {a.tokens} new tokens, {a.rounds} rounds; "
          f"fused kernels {'on' if kernels_on else 'off (no build: the bf16 rows are oneDNN too)'}")  # fmt: skip
    print(f"{'system':12} {'ms/token':>9} {'tok/s':>7} {'× fp32':>7} {'prompt ms':>10} {'same tokens':>12}  by round")
    for r in rows:
        print(f"{r['system']:12} {r['ms_per_token']:9.1f} {r['tokens_per_s']:7.1f} {base / r['ms_per_token']:7.2f} "
              f"{r['prompt_ms']:10.1f} {r['tokens_same_as_fp32']:>5}/{len(ref):<6}  {r['by_round_ms']}")  # fmt: skip
    if a.json:
        print(json.dumps({"model": resolve(None, cache).path.name, "backend": backend, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
