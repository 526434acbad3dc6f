"""LoRA training benchmark: lorad (each backend + auto) vs Hugging Face PEFT fp32 / bf16 on SmolLM2-135M-Instruct.

Every system trains the same adapter (same initial A/B, same packed batches, same AdamW + schedule + clipping) in its
own subprocess so its peak RSS is its own. Reported per system: median steady-state tokens/s (warm-up steps
skipped), peak RSS, RSS after model load, train loss at step K, held-out eval loss after K steps, and ratios to
PEFT fp32 and PEFT bf16.

    .venv/bin/python bench/train.py            # 30 steps per system
    .venv/bin/python bench/train.py --quick    # 8 steps, for a smoke run
    .venv/bin/python bench/train.py --json     # last stdout line: one JSON object
    .venv/bin/python bench/train.py --worker lorad-ort-cpu-w8a8 --profile /tmp/prof.txt   # pyinstrument one system
    .venv/bin/python bench/train.py --model qwen2-0.5b --systems lorad-auto,peft-bf16 --steps 10   # scaling row
    .venv/bin/python bench/train.py --steps 200 --systems lorad-auto,peft-fp32                     # convergence

lorad-auto is run twice: first with an empty plan cache (planning cold: `plan_cold_s`, `time_to_first_step_cold_s`),
then as measured with the plan cached (`time_to_first_step_s`, warm). ``--busy N`` adds the same two first-step
runs (short, not in the table) while N other processes spin, as a phone doing something else would
(`busy_plan_cold_s`, `busy_time_to_first_step_cold_s`, `busy_time_to_first_step_s`); the measured runs stay quiet
so every row's baselines run under the same conditions.

The lorad systems run under the malloc ``lorad serve`` would use here (``training.allocator``'s default: tcmalloc
where glibc Linux has it installed, server/allocator.py); the PEFT baselines under the system's malloc, as a user
runs them, or with ``--baseline-malloc daemon`` under the same one. Every row names its malloc.

``--interleave N`` runs the systems of a round side by side instead of one after another: every worker loads its
model (one at a time), then the workers take turns of N training steps each, round robin, one running while the
others wait blocked, so every system's steps sample the host's speed over the same minutes. This 2-core VM's speed
drifts by ±25 % over minutes, which one-after-another runs turn into ratio noise (SmolLM2, one-after-another rounds:
2.33-3.25x PEFT fp32); the ratios of an interleaved round compare steps taken within seconds of each other. That
narrowed the bf16 ratio's spread over rounds (1.92-2.03x against 1.65-2.07x) but not the fp32 one's (2.53-2.99x):
this host's phases also move PEFT's fp32 GEMMs against the bf16 ones within seconds (README, "Interleaved rounds").

lorad's trainer does not compute a packed sequence's trailing padding (``packing.trim_tail``); the PEFT baselines get
the packed batches whole, as Hugging Face computes them, or with ``--baseline-trim`` the same trimmed batches. Every
row reports the positions it computed per step (``positions_per_step``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MARK = "BENCH_RESULT "
TURN = "BENCH_TURN"  # a worker under --interleave hands the CPU back to the driver (and waits for "go")
SEQ_LEN, RANK, ALPHA, LR, WARMUP_LR, CLIP, SEED = 256, 8, 16.0, 2e-4, 3, 1.0, 1234
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (backend, precision, clip_mode, overlap). "global" clipping is what PEFT/HF Trainer do; with it the
# optimizer cannot step before the whole backward is done, so the overlap study uses per-layer clipping.
LORAD_SYSTEMS = {
    "lorad-torch-fp32": ("torch", "fp32", "global", True),
    "lorad-torch-bf16": ("torch", "bf16", "global", True),
    "lorad-torch-w8a8": ("torch", "w8a8", "global", True),
    "lorad-ort-cpu-fp32": ("ort-cpu", "fp32", "global", True),
    "lorad-ort-cpu-w8a8": ("ort-cpu", "w8a8", "global", True),
    "lorad-auto": ("auto", "auto", "global", True),
}
HTP_SYSTEMS = {"lorad-qnn-htp-fp16": ("qnn-htp", "fp16", "global", True)}
OVERLAP_SYSTEMS = {
    "lorad-auto-perlayer-overlap": ("auto", "auto", "per_layer", True),
    "lorad-auto-perlayer-sequential": ("auto", "auto", "per_layer", False),
}
ALL_LORAD = LORAD_SYSTEMS | HTP_SYSTEMS | OVERLAP_SYSTEMS
PEFT_SYSTEMS = ("peft-fp32", "peft-bf16")
# Random-weight models of other sizes for the scaling row (speed only: their losses mean nothing). Shapes of Qwen2-0.5B.
MODEL_PRESETS = {
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "use_sliding_window": False,
    },
}  # fmt: skip


def model_source(name: str | None, cache: Path) -> Path | None:
    """None (the bundled SmolLM2), an HF folder, or a preset built once in the cache: random bf16-exact weights
    (seeded, std 0.02) and SmolLM2's tokenizer (its ids fit any larger vocabulary)."""
    if name is None or name not in MODEL_PRESETS:
        return None if name is None else Path(name)
    out = cache / "bench-models" / name
    if (out / "model.safetensors").exists():
        return out

    import torch
    from safetensors.torch import save_file

    from lorad.server.engine.api import resolve

    cfg = MODEL_PRESETS[name]
    d, f, v, hd = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg["hidden_size"] // cfg["num_attention_heads"],
    )
    kv = cfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(SEED)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    sd = {"model.embed_tokens.weight": rnd(v, d), "model.norm.weight": torch.ones(d).bfloat16()}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n, shape in {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
                         "self_attn.o_proj": (d, d), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
                         "mlp.down_proj": (d, f)}.items():  # fmt: skip
            sd[p + n + ".weight"] = rnd(*shape)
        for n in ("q_proj", "k_proj", "v_proj"):  # Qwen2 has q/k/v biases
            sd[p + f"self_attn.{n}.bias"] = rnd(sd[p + f"self_attn.{n}.weight"].shape[0])
        sd[p + "input_layernorm.weight"] = torch.ones(d).bfloat16()
        sd[p + "post_attention_layernorm.weight"] = torch.ones(d).bfloat16()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(sd, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    smol = resolve(None, cache).path
    for t in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (smol / t).exists():
            shutil.copy(smol / t, tmp / t)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# -- deterministic, natural-looking corpus (no downloads) ---------------------------------------------------------
_PEOPLE = ["Mara", "the old baker", "my neighbour", "Tomas", "the ferry captain", "a young teacher", "Ines", "Grandpa"]
_PLACES = ["the harbour", "the market square", "a small kitchen", "the hill above town", "the library", "the garden"]
_TIMES = ["every morning", "before dawn", "on rainy afternoons", "in late autumn", "after dinner", "on Sundays"]
_ACTS = [
    "bakes rye bread",
    "repairs fishing nets",
    "reads old letters",
    "plants tomatoes",
    "feeds the stray cats",
    "writes down the tides",
    "sweeps the steps",
    "tunes a battered piano",
]
_FEEL = ["quietly", "with great care", "without hurry", "humming a tune", "as if nothing else mattered"]
_WHY = [
    "because the town expects it",
    "since it keeps the hands busy",
    "to remember someone who left",
    "because the light is best then",
    "for no reason anyone can name",
]
_QS = ["What does {p} do {t}?", "Where can I find {p} {t}?", "Why does {p} go to {pl}?", "Tell me about {p}."]


def _sentence(r: random.Random) -> str:
    p, t, a = r.choice(_PEOPLE), r.choice(_TIMES), r.choice(_ACTS)
    forms = [
        f"{t.capitalize()}, {p} {a} in {r.choice(_PLACES)}.",
        f"{p.capitalize()} {a} {r.choice(_FEEL)}.",
        f"In {r.choice(_PLACES)}, {p} {a} {r.choice(_WHY)}.",
        f"Nobody knows why {p} {a} {t}.",
    ]
    return r.choice(forms)


def corpus(n: int, seed: int = SEED) -> list[Any]:
    """n samples: 3 in 4 are short text paragraphs, 1 in 4 a user/assistant exchange (loss on the answer only)."""
    from lorad.server.engine.api import ChatSample, Message, TextSample

    r = random.Random(seed)
    out: list[Any] = []
    for i in range(n):
        if i % 4 == 3:
            q = r.choice(_QS).format(p=r.choice(_PEOPLE), t=r.choice(_TIMES), pl=r.choice(_PLACES))
            a = " ".join(_sentence(r) for _ in range(r.randint(2, 4)))
            out.append(ChatSample((Message("user", q), Message("assistant", a))))
        else:
            out.append(TextSample(" ".join(_sentence(r) for _ in range(r.randint(3, 7)))))
    return out


# -- shared pieces -----------------------------------------------------------------------------------------------
class _Turns:
    """A worker's turns under ``--interleave N`` (``every`` = N; 0: it runs straight through): it hands the CPU back
    to the driver once its model is loaded, after every N steps and after its last one, by printing ``TURN`` and
    blocking until the driver writes a line. ``waited`` is the time spent blocked (kept out of time-to-first-step)."""

    def __init__(self, every: int) -> None:
        self.every, self.waited = every, 0.0

    def hand_back(self) -> None:
        if not self.every:
            return
        t = time.perf_counter()
        print(TURN, flush=True)
        if not sys.stdin.readline():  # the driver is gone
            raise SystemExit(1)
        self.waited += time.perf_counter() - t

    def after_step(self, step: int, steps: int) -> None:
        """After step ``step`` (1-based) of ``steps``."""
        if self.every and (step % self.every == 0 or step == steps):
            self.hand_back()


def _rss_mb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB."""
    import psutil

    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return psutil.Process().memory_info().rss / 2**20, peak_kb / 1024


def _train_cfg(steps: int, backend: str, precision: str, clip_mode: str = "global", overlap: bool = True) -> Any:
    from lorad.server.engine.api import TrainConfig

    return TrainConfig(
        rank=RANK,
        alpha=ALPHA,
        dropout=0.0,
        lr=LR,
        steps=steps,
        batch_size=1,
        seq_len=SEQ_LEN,
        grad_accum=1,
        warmup_steps=WARMUP_LR,
        schedule="cosine",
        weight_decay=0.0,
        max_grad_norm=CLIP,
        clip_mode=clip_mode,
        overlap_optimizer=overlap,
        eval_fraction=0.1,
        eval_batches=4,
        seed=SEED,
        backend=backend,
        precision=precision,
    )


def _data(model_dir: Path, cfg: Any) -> Any:
    from lorad.server.engine.api import ChatTokenizer, prepare

    tok = ChatTokenizer.from_dir(model_dir)
    return prepare(corpus(600), tok, seq_len=cfg.seq_len, eval_fraction=cfg.eval_fraction), tok


def make_init_adapter(model_dir: Path, out: Path) -> None:
    """PEFT-style initial adapter (A kaiming-uniform(a=√5) = U(±1/√in), B = 0) from a fixed seed, shared by all."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim") or 64
    kv = cfg["num_key_value_heads"] * hd
    shapes = {
        "self_attn.q_proj": (cfg["num_attention_heads"] * hd, d),
        "self_attn.k_proj": (kv, d),
        "self_attn.v_proj": (kv, d),
        "self_attn.o_proj": (d, cfg["num_attention_heads"] * hd),
        "mlp.gate_proj": (f, d),
        "mlp.up_proj": (f, d),
        "mlp.down_proj": (d, f),
    }
    g = torch.Generator().manual_seed(SEED)
    sd = {}
    for i in range(cfg["num_hidden_layers"]):
        for name, (o, n_in) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{name}"
            sd[f"{key}.lora_A.weight"] = (torch.rand(RANK, n_in, generator=g) * 2 - 1) / math.sqrt(n_in)
            sd[f"{key}.lora_B.weight"] = torch.zeros(o, RANK)
    save_file(sd, str(out))


def _summary(
    times: list[float], cpu: list[float], losses: list[float], eval_loss: float | None, warmup: int, extra: dict
) -> dict:
    steady = times[warmup:] or times
    steady_cpu = cpu[warmup:] or cpu
    rss, peak = _rss_mb()
    return {
        "tokens_per_s": SEQ_LEN / statistics.median(steady),
        "step_s_median": statistics.median(steady),
        # CPU seconds of this process per step: less sensitive than wall time to other load on a shared host.
        "tokens_per_cpu_s": SEQ_LEN / statistics.median(steady_cpu),
        "cpu_s_median": statistics.median(steady_cpu),
        "loss_at_k": losses[-1],
        "loss_last5": statistics.fmean(losses[-5:]),
        "eval_loss": eval_loss,
        "peak_rss_mb": peak,
        "rss_end_mb": rss,
        "losses": losses,
        "step_s": times,
        **extra,
    }


# -- workers -----------------------------------------------------------------------------------------------------
def worker_lorad(system: str, a: argparse.Namespace) -> dict:
    from safetensors.torch import load_file

    from lorad.server.engine.api import (
        LoraConfig,
        Trainer,
        known_plan,
        load_model,
        plan_job,
        plans_here,
        resolve,
        resolve_backend,
        resolve_precision,
        seed_everything,
    )

    backend, precision, clip_mode, overlap = ALL_LORAD[system]
    if backend == "auto":
        info = resolve_backend("auto")  # the engine's standalone decision, as the daemon makes it at start
        backend, precision, reason = info.name, resolve_precision("auto", info.name), info.reason
    else:
        reason = "fixed"
    cfg = _train_cfg(a.steps, backend, precision, clip_mode, overlap)
    seed_everything(SEED)
    t0 = time.perf_counter()
    lora = LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.0)
    plan_info: dict[str, Any] = {}
    job = None
    cache = Path(a.cache)
    source = model_source(a.model, cache)
    auto = system.startswith("lorad-auto") and plans_here(backend, "auto")
    with tempfile.TemporaryDirectory() as work:
        if auto:
            # The product's "auto" path: a cached plan is built directly; otherwise plan (cold) and re-lower.
            auto_cfg = replace(cfg, precision="auto")
            job = known_plan(resolve(source, cache).model_hash, auto_cfg, backend=backend, work_dir=Path(work),
                             cache_root=cache, resuming=False)  # fmt: skip
            plan_info["plan_warm"] = job is not None
        loaded = load_model(source, cache_root=cache, backend=backend, precision=job.plan if job else precision,
                            lora=lora)  # fmt: skip
        if auto and job is None:
            t_plan = time.perf_counter()
            ticks = [t_plan]
            job = plan_job(loaded, auto_cfg, backend=backend, work_dir=Path(work), cache_root=cache,
                           on_progress=lambda _f: ticks.append(time.perf_counter()))  # fmt: skip
            plan_info["plan_s"] = time.perf_counter() - t_plan
            # The planner's own progress granularity (the daemon adds a 1 s heartbeat on top of it).
            plan_info["plan_progress_max_gap_s"] = max(b - a for a, b in itertools.pairwise(ticks))
    if job is not None:
        counts: dict[str, int] = {}
        for _n, pf, pb in job.layers():
            counts[f"{pf}/{pb}"] = counts.get(f"{pf}/{pb}", 0) + 1
        precision = "plan:" + ",".join(f"{k}x{v}" for k, v in sorted(counts.items()))
        plan_info["plan"] = job.plan.summary()
        plan_info["plan_costs_ms"] = job.plan.costs
    loaded.model.load_lora_state_dict(load_file(a.init))
    load_s = time.perf_counter() - t0
    rss_load, peak_load = _rss_mb()
    data, tok = _data(loaded.checkpoint.path, cfg)
    trainer = Trainer(loaded.model, cfg, data, pad_id=tok.eos_id or 0)
    fed: list[int] = []  # positions per training forward (the trainer trims trailing padding)
    loaded.model.register_forward_pre_hook(lambda m, args: fed.append(int(args[0].shape[1])) if m.training else None)
    plan_info["model"] = loaded.checkpoint.path.name if source is not None else "SmolLM2-135M-Instruct"
    prof = None
    if a.profile:
        from pyinstrument import Profiler

        for _ in range(a.warmup):  # profile steady state only
            trainer.train_step()
        prof = Profiler(interval=0.005)
        prof.start()
    cpu: list[float] = []
    first: list[float] = []
    turns = _Turns(a.turn_every)
    turns.hand_back()  # loaded: the driver lets the steps start when it is this system's turn
    last = [time.process_time()]

    def on_progress(p: Any) -> None:
        if not first:  # model load (+ plan lookup or planning) through step 1, without waiting for a turn
            first.append(time.perf_counter() - t0 - turns.waited)
        now = time.process_time()
        cpu.append(now - last[0])
        turns.after_step(p.step, a.steps)
        last[0] = time.process_time()

    trainer.on_progress = on_progress
    res = trainer.run()
    if prof is not None:
        prof.stop()
        Path(a.profile).write_text(prof.output_text(unicode=True, color=False, show_all=False))
    losses = res.losses
    pad = [0.0] * (a.warmup if a.profile else 0)
    times, cpu = pad + res.step_times, pad + cpu
    ev = res.eval_losses[-1][1] if res.eval_losses else None
    trainer.close()
    return _summary(
        times,
        cpu,
        losses,
        ev,
        a.warmup,
        {
            "backend": backend,
            "precision": precision,
            "reason": reason,
            "load_s": load_s,
            "time_to_first_step_s": first[0] if first else None,
            "rss_after_load_mb": rss_load,
            "peak_rss_after_load_mb": peak_load,
            "clip_mode": clip_mode,
            # torch's intra-op threads in a step (1 beside ORT's pool unless torch's idle workers sleep)
            "step_torch_threads": loaded.model.torch_threads or a.threads,
            "overlap": overlap,
            **plan_info,
            "optim_ms_median": 1e3 * statistics.median(res.optim_times),
            "optim_wait_ms_median": 1e3 * statistics.median(res.optim_waits),
            "positions_per_step": statistics.fmean(fed[-a.steps :]) if fed else None,
        },
    )


def worker_peft(system: str, a: argparse.Namespace) -> dict:
    import peft
    import torch
    import transformers as tf
    from safetensors.torch import load_file

    from lorad.server.engine.api import BatchStream, eval_batches, lr_at, resolve, seed_everything, trim_tail

    cfg = _train_cfg(a.steps, "torch", "fp32")
    seed_everything(SEED)
    t0 = time.perf_counter()
    model_dir = resolve(model_source(a.model, Path(a.cache)), Path(a.cache)).path
    base = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base.config.use_cache = False
    pcfg = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=HF_TARGETS, bias="none", task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(base, pcfg)
    res = peft.set_peft_model_state_dict(model, load_file(a.init))
    assert not res.unexpected_keys, res.unexpected_keys[:3]
    load_s = time.perf_counter() - t0
    rss_load, peak_load = _rss_mb()
    data, tok = _data(model_dir, cfg)
    stream = BatchStream(data.train, seq_len=SEQ_LEN, batch_size=1, seed=SEED, pad_id=tok.eos_id or 0)
    held = eval_batches(data.eval, seq_len=SEQ_LEN, batch_size=1, pad_id=tok.eos_id or 0, max_batches=4)
    trim = trim_tail if a.baseline_trim else lambda x, y: (x, y)
    held = [trim(x, y) for x, y in held]
    fed: list[int] = []
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.0)
    bf16 = system == "peft-bf16"
    model.train()
    times, cpu, losses = [], [], []
    turns = _Turns(a.turn_every)
    turns.hand_back()
    for step in range(a.steps):
        t, c = time.perf_counter(), time.process_time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr=LR, steps=a.steps, warmup_steps=WARMUP_LR, schedule="cosine")
        b = stream.next_batch()
        x, y = trim(b.input_ids, b.labels)
        fed.append(int(x.shape[1]))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        turns.after_step(step + 1, a.steps)
    model.eval()
    num = den = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for x, y in held:
            n = int((y[:, 1:] != -100).sum())
            num += float(model(input_ids=x, labels=y).loss) * n
            den += n
    return _summary(
        times,
        cpu,
        losses,
        num / den,
        a.warmup,
        {
            "backend": "transformers+peft",
            "precision": "bf16-autocast" if bf16 else "fp32",
            "load_s": load_s,
            "time_to_first_step_s": load_s + times[0] if times else None,
            "rss_after_load_mb": rss_load,
            "peak_rss_after_load_mb": peak_load,
            "positions_per_step": statistics.fmean(fed),
        },
    )


def run_worker(a: argparse.Namespace) -> None:
    if a.worker not in PEFT_SYSTEMS:  # as `lorad serve` decides its backend: before torch loads
        from lorad.server.backend import decide_backend

        decide_backend(ALL_LORAD[a.worker][0])
    import torch

    from lorad.kernels.cpu_threads import WAIT_POLICY
    from lorad.server.engine.api import malloc_in_use

    torch.set_num_threads(a.threads)
    out = worker_peft(a.worker, a) if a.worker in PEFT_SYSTEMS else worker_lorad(a.worker, a)
    out["torch_threads"] = torch.get_num_threads()
    out["omp_wait_policy"] = os.environ.get(WAIT_POLICY, "libgomp default")
    out["malloc"] = malloc_in_use()
    print(MARK + json.dumps(out), flush=True)


# -- driver ------------------------------------------------------------------------------------------------------
def _worker_cmd(
    system: str, a: argparse.Namespace, init: Path, *, cache: str | None = None, steps: int | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one system's worker process."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        system,
        "--steps",
        str(steps or a.steps),
        "--warmup",
        str(a.warmup),
        "--cache",
        cache or a.cache,
        "--init",
        str(init),
        "--threads",
        str(a.threads),
        *(["--model", a.model] if a.model else []),
        *(["--baseline-trim"] if a.baseline_trim and system in PEFT_SYSTEMS else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
    if system not in PEFT_SYSTEMS or a.baseline_malloc == "daemon":
        from lorad.server.allocator import preload_env
        from lorad.server.config import TrainingSection

        env = preload_env(TrainingSection().allocator, env) or env  # as `lorad serve` starts with its defaults
    return cmd, env


def _spawn(
    system: str, a: argparse.Namespace, init: Path, *, cache: str | None = None, steps: int | None = None
) -> dict:
    cmd, env = _worker_cmd(system, a, init, cache=cache, steps=steps)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=a.timeout)
    return _result(system, p.returncode, p.stdout, p.stderr, time.perf_counter() - t0)


def _result(system: str, code: int, out: str, err: str, wall_s: float) -> dict:
    """A worker's result row from its exit code and output (an ``error`` row when it failed)."""
    lines = [ln for ln in out.splitlines() if ln.startswith(MARK)]
    if code != 0 or not lines:
        tail = (err or out)[-1500:]
        return {"system": system, "error": f"exit {code}: {tail}"}
    r = json.loads(lines[-1][len(MARK) :])
    r["system"], r["wall_s"] = system, wall_s
    return r


def _interleaved(systems: list[str], a: argparse.Namespace, init: Path) -> dict[str, dict]:
    """Every system's worker run side by side in turns of ``a.interleave`` steps (see the module docstring): each
    loads alone, then the driver gives the turns round robin until every worker has exited; a worker's eval and
    result follow its last turn, alone too. A worker that fails, or the group outliving ``a.timeout`` seconds per
    system, ends that worker with an error row."""
    t0 = time.perf_counter()
    procs: dict[str, subprocess.Popen[str]] = {}
    outs: dict[str, list[str]] = {s: [] for s in systems}
    errs: dict[str, Any] = {}
    deadline = t0 + a.timeout * len(systems)
    late: set[str] = set()

    def turn(s: str) -> bool:
        """Reads ``s``'s output until it hands the CPU back (True) or exits (False; ended here past the deadline)."""
        p = procs[s]
        assert p.stdout is not None
        for line in p.stdout:
            if line.rstrip("\n") != TURN:
                outs[s].append(line)
            elif time.perf_counter() < deadline:
                return True
            else:
                late.add(s)
                break
        _stop(p)
        return False

    try:
        live: list[str] = []
        for s in systems:  # one at a time: loading (and a plan lookup) is not part of anyone's steps
            cmd, env = _worker_cmd(s, a, init)
            errs[s] = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed below)
            procs[s] = subprocess.Popen([*cmd, "--turn-every", str(a.interleave)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=errs[s], text=True, env=env)  # fmt: skip
            if turn(s):
                live.append(s)
        while live:
            for s in list(live):
                stdin = procs[s].stdin
                assert stdin is not None
                stdin.write("go\n")
                stdin.flush()
                if not turn(s):
                    live.remove(s)
    finally:
        for p in procs.values():
            _stop(p)
    got = {}
    for s in systems:
        errs[s].seek(0)
        got[s] = _result(s, procs[s].returncode, "".join(outs[s]), errs[s].read(), time.perf_counter() - t0)
        errs[s].close()
        if s in late:
            got[s] = {"system": s, "error": f"ended: the systems ran past --timeout ({a.timeout:g} s each)"}
    return got


def _stop(p: subprocess.Popen[str]) -> None:
    """Ends a worker that is still running; waits for it either way."""
    if p.poll() is None:
        p.kill()
    p.wait()


def _init_path(a: argparse.Namespace) -> Path:
    return Path(a.cache) / f"bench-init-adapter-{Path(a.model).name if a.model else 'smollm2'}.safetensors"


def _first_steps(a: argparse.Namespace, init: Path) -> dict[str, Any]:
    """The cold plan run (see ``_cold_plan``), and with ``--busy N`` the cold and a warm first step again while N
    processes spin."""
    out = _cold_plan(a, init, "")
    if a.busy:
        busy = _spin(a.busy)
        try:
            out |= _cold_plan(a, init, "busy_")
            warm = _spawn("lorad-auto", a, init, steps=WARMUP_LR + 1)
            out["busy_time_to_first_step_s"] = warm.get("time_to_first_step_s")
        finally:
            for b in busy:
                b.kill()
        out["busy_processes"] = a.busy
    return out


def _cold_plan(a: argparse.Namespace, init: Path, prefix: str) -> dict[str, Any]:
    """lorad-auto for a few steps with an empty plan and cost cache (the converted model is reused): what a first job
    on a new device waits for."""
    print(f"# running lorad-auto with an empty plan cache (cold{', busy' if prefix else ''}) ...", file=sys.stderr,
          flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "models").symlink_to(Path(a.cache).resolve() / "models")
        if (Path(a.cache) / "bench-models").exists():
            (Path(tmp) / "bench-models").symlink_to(Path(a.cache).resolve() / "bench-models")
        r = _spawn("lorad-auto", a, init, cache=tmp, steps=WARMUP_LR + 1)  # the schedule needs steps > warm-up
        if not prefix:  # the measured run then finds this (quiet) plan and cost table cached: the warm path
            plans = Path(a.cache) / "plans"
            plans.mkdir(parents=True, exist_ok=True)
            for f in (Path(tmp) / "plans").glob("*.json"):
                shutil.copy(f, plans / f.name)  # replaces a plan an older run cached under the same key
    if "error" in r:
        return {f"{prefix}plan_cold_error": r["error"]}
    keys = {"plan_cold_s": "plan_s", "time_to_first_step_cold_s": "time_to_first_step_s",
            "plan_progress_max_gap_s": "plan_progress_max_gap_s"}  # fmt: skip
    return {prefix + k: r.get(src) for k, src in keys.items()}


def _spin(n: int) -> list[subprocess.Popen]:
    """n processes that keep a core busy each (the "another process keeps both cores busy" condition)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _table(rows: list[dict]) -> str:
    ref = {r["system"]: r for r in rows if "error" not in r}
    f32, b16 = ref.get("peft-fp32"), ref.get("peft-bf16")
    head = (
        f"{'system':30} {'backend/prec':22} {'tok/s':>7} {'×fp32':>6} {'×bf16':>6} {'tok/cpu-s':>9} {'peakRSS':>8} "
        f"{'RSSxfp32':>8} {'RSSload':>8} {'loss@K':>7} {'eval':>7} {'Δeval%':>7} {'optim ms':>8} malloc"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"{r['system']:30} ERROR {r['error'][:200]!r}")
            continue
        x32 = r["tokens_per_s"] / f32["tokens_per_s"] if f32 else float("nan")
        x16 = r["tokens_per_s"] / b16["tokens_per_s"] if b16 else float("nan")
        rss = r["peak_rss_mb"] / f32["peak_rss_mb"] if f32 else float("nan")
        dev = 100 * (r["eval_loss"] / f32["eval_loss"] - 1) if f32 and r.get("eval_loss") else float("nan")
        r.update(x_peft_fp32=x32, x_peft_bf16=x16, rss_x_peft_fp32=rss, eval_dev_pct=dev)
        optim = f"{r['optim_ms_median']:8.1f}" if "optim_ms_median" in r else f"{'-':>8}"
        out.append(
            f"{r['system']:30} {r['backend'] + '/' + r['precision']:22} {r['tokens_per_s']:7.1f} {x32:6.2f} "
            f"{x16:6.2f} {r['tokens_per_cpu_s']:9.1f} {r['peak_rss_mb']:7.0f}M {rss:8.2f} "
            f"{r['rss_after_load_mb']:7.0f}M {r['loss_at_k']:7.4f} {r['eval_loss']:7.4f} {dev:+7.2f} {optim} "
            f"{r.get('malloc', '?')}"
        )
    return "\n".join(out)


def _median_rows(rounds: list[list[dict]], first_steps: dict[str, dict]) -> list[dict]:
    """One row per system: its median-speed round's row, with the ratios (which ``_table`` set on every round's rows)
    replaced by the median of the per-round ratios (each against the baselines of the same round) and every round's
    values listed, plus the system's first-step runs (``_first_steps``, round 1 only)."""
    out = []
    for i, first in enumerate(rounds[0]):
        runs = [rs[i] for rs in rounds if "error" not in rs[i]]
        if not runs:
            out.append(first)
            continue
        mid = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        row = dict(mid) | first_steps.get(first["system"], {})
        for key in ("x_peft_fp32", "x_peft_bf16", "rss_x_peft_fp32", "eval_dev_pct"):
            vals = [r[key] for r in runs if key in r]
            if vals:
                row[key] = statistics.median(vals)
                row[f"rounds_{key}"] = [round(v, 3) for v in vals]
        row["rounds_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in runs]
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 steps per system instead of 30")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--steps", type=int, default=None, help="steps per system (K); default 30, 8 with --quick")
    ap.add_argument("--warmup", type=int, default=None, help="steps excluded from the median (default 3, 2 quick)")
    ap.add_argument("--systems", default=None, help="comma-separated subset of systems")
    ap.add_argument("--htp", action="store_true", help="also run the QNN HTP backend (the x86 simulator is slow)")
    ap.add_argument(
        "--overlap-study",
        action="store_true",
        help="also run lorad-auto with per-layer clipping, optimizer overlapped vs sequential",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch/OMP threads per system")
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "lorad"), help="model conversion cache")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per system")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--profile", default=None, help="with --worker: write a pyinstrument report of the steps here")
    ap.add_argument(
        "--model", default=None, help=f"an HF folder or a preset ({', '.join(MODEL_PRESETS)}); default SmolLM2"
    )
    ap.add_argument(
        "--baseline-malloc",
        choices=("system", "daemon"),
        default="system",
        help="the PEFT baselines' malloc: the system's (default), or the one lorad serve uses here",
    )
    ap.add_argument(
        "--baseline-trim",
        action="store_true",
        help="feed the PEFT baselines the batches lorad's trainer computes (trailing padding cut) instead of whole",
    )
    ap.add_argument("--busy", type=int, default=0, help="also time lorad-auto's first steps with N processes spinning")
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="N",
        help="run a round's systems side by side, taking turns of N steps each (0: one after another)",
    )
    ap.add_argument("--turn-every", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system R times in alternating order; ratios per round (neighbouring runs), then their median",
    )
    a = ap.parse_args()
    if a.interleave < 0:
        ap.error(f"--interleave {a.interleave}: give a number of steps per turn (>= 1), or 0 for one after another")
    a.steps = a.steps or (8 if a.quick else 30)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 3)
    if a.worker:
        if not a.init:
            a.init = str(_init_path(a))
        run_worker(a)
        return
    from lorad.server.engine.api import resolve

    t0 = time.perf_counter()
    model_dir = resolve(model_source(a.model, Path(a.cache)), Path(a.cache)).path  # GGUF converted once, then cached
    init = _init_path(a)
    make_init_adapter(model_dir, init)
    systems = [
        *LORAD_SYSTEMS,
        *(HTP_SYSTEMS if a.htp else {}),
        *(OVERLAP_SYSTEMS if a.overlap_study else {}),
        *PEFT_SYSTEMS,
    ]
    if a.systems:
        systems = [s for s in a.systems.split(",") if s]
    rounds: list[list[dict]] = []
    first_steps: dict[str, dict] = {}
    for k in range(max(a.rounds, 1)):
        # The host's speed drifts over minutes (this 2-core VM: ±25 %); alternating the order puts every system
        # next to its baselines early and late, and each round's ratios compare neighbouring runs.
        got: dict[str, dict] = {}
        order = systems if k % 2 == 0 else systems[::-1]
        if k == 0 and "lorad-auto" in systems:
            first_steps["lorad-auto"] = _first_steps(a, init)
        if a.interleave:
            print(f"# round {k + 1}: running {', '.join(order)} side by side, turns of {a.interleave} steps ...",
                  file=sys.stderr, flush=True)  # fmt: skip
            got = _interleaved(order, a, init)
        for s in order:
            if not a.interleave:
                print(f"# round {k + 1}: running {s} ({a.steps} steps) ...", file=sys.stderr, flush=True)
                got[s] = _spawn(s, a, init)
            r = got[s] = got[s] | (first_steps.get(s, {}) if k == 0 else {})
            msg = r.get("error") or "{:.1f} tok/s, peak {:.0f} MiB, {:.0f}s".format(
                r["tokens_per_s"], r["peak_rss_mb"], r["wall_s"]
            )
            print(f"#   {s}: {msg}", file=sys.stderr, flush=True)
        rounds.append([got[s] for s in systems])
    tables = [_table(rs) for rs in rounds]
    rows = rounds[0] if len(rounds) == 1 else _median_rows(rounds, first_steps)
    print(
        f"{a.model or 'SmolLM2-135M-Instruct'}, seq {SEQ_LEN}, batch 1, LoRA r={RANK} alpha={ALPHA:g} on all 7 "
        "projections, "
        f"K={a.steps} steps ({a.warmup} warm-up excluded), {a.threads} threads, {len(rounds)} round(s)"
        + (f" interleaved in turns of {a.interleave} steps" if a.interleave else "")
        + ", "
        f"total {time.perf_counter() - t0:.0f}s; positions computed per step (of {SEQ_LEN}): "
        + ", ".join(f"{r['system']} {r['positions_per_step']:.1f}" for r in rows if r.get("positions_per_step"))
    )
    for k, table in enumerate(tables):
        print(f"round {k + 1}" if len(tables) > 1 else "", table, sep="\n" if len(tables) > 1 else "")
    if len(rounds) > 1:
        print(f"median over {len(rounds)} rounds (ratios: median of each round's own ratio)")
        for r in rows:
            if "error" not in r:
                x32, x16 = f"×fp32 {r['x_peft_fp32']:5.2f} {r['rounds_x_peft_fp32']}", f"×bf16 {r['x_peft_bf16']:5.2f}"
                print(f"{r['system']:30} {r['tokens_per_s']:7.1f} tok/s  {x32}  {x16} {r['rounds_x_peft_bf16']}")
    if a.json:
        slim = [
            {k: v for k, v in r.items() if k not in ("losses", "step_s")} | {"losses": r.get("losses")} for r in rows
        ]
        print(
            json.dumps(
                {
                    "steps": a.steps,
                    "warmup": a.warmup,
                    "seq_len": SEQ_LEN,
                    "threads": a.threads,
                    "interleave": a.interleave,
                    "rounds": len(rounds),
                    "systems": slim,
                }
            )
        )


if __name__ == "__main__":
    main()
