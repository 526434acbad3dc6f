"""A tiny random Qwen2-style Hugging Face folder (q/k/v biases, GQA) written without transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 4, 2, 16, 256


def write_tiny_qwen2(folder: Path, seed: int = 0) -> Path:
    """Write config.json + model.safetensors for a 2-layer Qwen2 with random weights; returns ``folder``."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN), "model.norm.weight": rnd(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for name, (out_f, in_f) in {
            "self_attn.q_proj": (q, HIDDEN), "self_attn.k_proj": (kv, HIDDEN), "self_attn.v_proj": (kv, HIDDEN),
            "self_attn.o_proj": (HIDDEN, q), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
            "mlp.down_proj": (HIDDEN, INTER),
        }.items():  # fmt: skip
            w[f"{p}.{name}.weight"] = rnd(out_f, in_f)
            if name.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                w[f"{p}.{name}.bias"] = rnd(out_f)
        w[f"{p}.input_layernorm.weight"] = rnd(HIDDEN)
        w[f"{p}.post_attention_layernorm.weight"] = rnd(HIDDEN)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(w, str(folder / "model.safetensors"))
    cfg = {
        "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
