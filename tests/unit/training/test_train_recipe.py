"""The recipe on the real lorad CausalLM (tiny random Llama, torch backend): train, save, pause, resume."""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.config import ModelConfig
from lorad.server.engine.training.config import TrainConfig
from lorad.server.engine.training.recipe import run_recipe
from tests.fixtures.tiny_lm import VOCAB, CharTokenizer, corpus

MCFG = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position=128,
)


def _weights(cfg: ModelConfig = MCFG) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "self_attn.q_proj": (q, d),
        "self_attn.k_proj": (kv, d),
        "self_attn.v_proj": (kv, d),
        "self_attn.o_proj": (d, q),
        "mlp.gate_proj": (f, d),
        "mlp.up_proj": (f, d),
        "mlp.down_proj": (d, f),
    }
    w = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, d, generator=g), "model.norm.weight": torch.ones(d)}
    for i in range(cfg.num_layers):
        for n, s in shapes.items():
            w[f"model.layers.{i}.{n}.weight"] = torch.randn(*s, generator=g) / s[1] ** 0.5
        w[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(d)
        w[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(d)
    return w


def tiny_load(source: Any, *, cache_root: Path, backend: str, precision: str, lora: Any) -> SimpleNamespace:
    model = build_model(MCFG, _weights(), backend=backend, precision=precision, lora=lora)
    return SimpleNamespace(model=model, tokenizer=CharTokenizer(), model_hash="tiny", tokenizer_hash="char")


CFG = TrainConfig(
    steps=6,
    seq_len=48,
    lr=1e-2,
    warmup_steps=1,
    dropout=0.1,
    eval_fraction=0.2,
    eval_every=3,
    backend="torch",
    precision="fp32",
    clip_mode="per_layer",
    seed=5,
)
SAMPLES = corpus(40)


def _run(tmp: Path, cfg: TrainConfig = CFG, **kw: Any) -> Any:
    return run_recipe(cfg, SAMPLES, work_dir=tmp, cache_root=tmp / "cache", load=tiny_load, **kw)


def test_recipe_trains_and_saves(tmp_path: Path) -> None:
    r = _run(tmp_path)
    assert r.status == "completed" and r.step == 6 and r.backend == "torch" and r.resumed_from is None
    assert r.eval_losses[-1][1] < r.eval_losses[0][1] + 1e-3
    sd = load_file(str(r.adapter_dir / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in sd
    assert any(float(v.abs().max()) > 0 for k, v in sd.items() if "lora_B" in k)
    meta = json.loads((r.adapter_dir / "training_metadata.json").read_text())
    assert meta["base_model_hash"] == "tiny" and meta["steps"] == 6 and meta["config"]["rank"] == 8


def test_recipe_pause_then_resume_is_exact(tmp_path: Path) -> None:
    ref = _run(tmp_path / "straight")
    n: list[int] = []
    p = _run(tmp_path / "job", on_progress=lambda pr: n.append(pr.step), should_pause=lambda: len(n) >= 3)
    assert p.status == "paused" and p.step == 3 and p.adapter_dir is None
    r = _run(tmp_path / "job")
    assert r.resumed_from == 3 and r.status == "completed"
    assert r.losses == ref.losses and r.eval_losses == ref.eval_losses
    a = load_file(str(ref.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(r.adapter_dir / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("clip_mode", ["per_layer", "global"])
def test_overlap_does_not_change_numbers_on_real_model(tmp_path: Path, clip_mode: str) -> None:
    from dataclasses import replace

    on = _run(tmp_path / "on", replace(CFG, overlap_optimizer=True, clip_mode=clip_mode))
    off = _run(tmp_path / "off", replace(CFG, overlap_optimizer=False, clip_mode=clip_mode))
    assert on.losses == off.losses
    a = load_file(str(on.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(off.adapter_dir / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_slow_model_load_and_first_step_are_heard_at_least_every_two_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the first PROGRESS a job loads its model and builds its step kernels, seconds each on a phone: the
    phase is repeated meanwhile (the product promise: an event at least every 2 s)."""
    import itertools
    import time

    from lorad.server.engine.training.trainer import Trainer

    def slow_load(*a: Any, **k: Any) -> Any:
        time.sleep(2.6)
        return tiny_load(*a, **k)

    real_step, calls = Trainer.train_step, []

    def slow_first_step(self: Trainer) -> tuple[float, float, float]:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(2.6)
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", slow_first_step)
    times: list[float] = []
    seen: list[str] = []

    def heard(what: str) -> None:
        times.append(time.monotonic())
        seen.append(what)

    run_recipe(CFG, SAMPLES, work_dir=tmp_path, cache_root=tmp_path / "cache", load=slow_load,
               on_phase=lambda p, f: heard(p), on_progress=lambda pr: heard(f"step {pr.step}"))  # fmt: skip
    before_first = times[: seen.index("step 1") + 1]
    assert seen.count("loading") >= 3 and seen[: seen.index("step 1")].count("training") >= 3, seen
    assert max(b - a for a, b in itertools.pairwise(before_first)) < 2.0
