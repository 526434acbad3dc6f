"""Tiny random Hugging Face checkpoints (Llama, Qwen2 with biases, Qwen3 with q/k norm) saved to tmp folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 320


def save_tiny_hf(tmp: Path, arch: str, seed: int = 0, tie: bool = True) -> Path:
    """Saves a 2-layer random transformers model of `arch` and returns its folder."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "llama3":
        cfg = tf.LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=1000000.0)
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=16, rope_theta=1000000.0)
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random init leaves norms at 1 and biases at 0; perturb them so the test can see mistakes there.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    out = tmp / arch
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {a: save_tiny_hf(root, a) for a in ("llama", "llama3", "qwen2", "qwen3")}
