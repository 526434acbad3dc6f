"""Real-model precision study: loss of one fixed batch per precision layout, and fast-planner time, on SmolLM2-135M.

Usage: python bench/plan_smollm2.py [--cache-root .cache/lorad] [--tokens 128] [--threads 2] [--no-plan] [--json]
The batch is the demo persona chats packed into ``--tokens`` tokens (loss on assistant tokens, as in training).
Layouts: fp32 everywhere; w8a8 everywhere; w8a8 except the lm_head; each w8a8 with per-row and per-tensor
activation scales (ort-cpu). LoRA B starts at zero, so each loss is the base model's loss under that layout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from lorad.kernels._swap import frozen_sites, swap_all
from lorad.kernels.ort_cpu import OrtCpuFrozenLinear

DEMO = Path(__file__).resolve().parents[1] / "client" / "demo_data" / "mara.jsonl"


def batch(tok: Any, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One [1, tokens] sequence of packed demo chats; labels only on assistant tokens."""
    ids: list[int] = []
    labels: list[int] = []
    for line in DEMO.read_text().splitlines():
        chat = json.loads(line)["messages"]
        i, m = tok.render_chat(chat)
        ids += i
        labels += [t if k else -100 for t, k in zip(i, m, strict=True)]
        if len(ids) >= tokens:
            break
    return torch.tensor([ids[:tokens]]), torch.tensor([labels[:tokens]])


def hf_weights(loaded: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """HF layer name -> (W, bias) for every frozen linear of the loaded model, lm_head included (tied)."""
    from lorad.server.engine.api import read_weights

    w = read_weights(loaded.checkpoint.path)
    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for k, v in w.items():
        if k.endswith(".weight") and k.startswith("model.layers.") and v.dim() == 2:
            n = k[: -len(".weight")]
            out[n] = (v.float(), w[n + ".bias"].float() if n + ".bias" in w else None)
    out["lm_head"] = (w.get("lm_head.weight", w["model.embed_tokens.weight"]).float(), None)
    return out


def layout_loss(model: Any, sites: Any, weights: Any, prec: dict[str, str], act: str, ids: Any, lab: Any) -> float:
    frozen = {
        n: OrtCpuFrozenLinear(w, b, precision=prec[n], precision_bwd=prec[n], name=n, act_quant=act)
        for n, (w, b) in weights.items()
    }
    swap_all(sites, frozen)
    with torch.no_grad():
        return float(model(ids, lab))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-root", type=Path, default=Path(".cache/lorad"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--no-plan", action="store_true")
    ap.add_argument("--no-layouts", action="store_true", help="skip the per-layout loss study")
    ap.add_argument("--plan-out", type=Path, help="write the plan JSON here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lorad.server.engine.api import LoraConfig, load_model

    t0 = time.perf_counter()
    loaded = load_model(None, cache_root=args.cache_root, backend="ort-cpu", precision="fp32", lora=LoraConfig())
    model = loaded.model
    weights = hf_weights(loaded)
    sites = frozen_sites(model, list(weights))
    originals = {n: fl for n, (fl, _) in sites.items()}
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {len(weights)} frozen linears")
    ids, lab = batch(loaded.tokenizer, args.tokens)
    res: dict[str, Any] = {"tokens": args.tokens, "labelled": int((lab != -100).sum()), "loss": {}}
    with torch.no_grad():
        res["loss"]["fp32"] = float(model(ids, lab))
    for act in () if args.no_layouts else ("row", "tensor"):
        all8 = dict.fromkeys(weights, "w8a8")
        res["loss"][f"w8a8_{act}"] = layout_loss(model, sites, weights, all8, act, ids, lab)
        res["loss"][f"w8a8_{act}_head_fp32"] = layout_loss(model, sites, weights, {**all8, "lm_head": "fp32"}, act,
                                                           ids, lab)  # fmt: skip
        res["loss"][f"w8a8_{act}_only_head"] = layout_loss(
            model, sites, weights, {**dict.fromkeys(weights, "fp32"), "lm_head": "w8a8"}, act, ids, lab
        )
    swap_all(sites, originals)
    for k, v in res["loss"].items():
        print(f"  loss {k:<28} {v:.4f}")
    if not args.no_plan:
        from lorad.kernels.planner import plan_precision

        def loss_fn() -> torch.Tensor:
            return model(ids, lab)

        t1 = time.perf_counter()
        plan = plan_precision(model, loss_fn, weights, backend="ort-cpu", candidates=("w8a8",), budget=args.budget,
                              mode="fast")  # fmt: skip
        res["plan_seconds"] = time.perf_counter() - t1
        res["plan_summary"] = plan.summary()
        print(plan.table())
        if args.plan_out:
            args.plan_out.write_text(json.dumps(plan.to_dict()))
        print(f"planned in {res['plan_seconds']:.1f} s: {plan.summary()}")
        pl = {n: plan.precisions(n) for n in weights}
        frozen = {n: OrtCpuFrozenLinear(w, b, precision=pl[n][0], precision_bwd=pl[n][1], name=n)
                  for n, (w, b) in weights.items()}  # fmt: skip
        swap_all(sites, frozen)
        with torch.no_grad():
            res["loss"]["plan"] = float(model(ids, lab))
        print(f"  loss with the plan: {res['loss']['plan']:.4f}")
    res["loadavg"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
