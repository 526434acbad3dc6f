"""Build-time memory: a tied embedding is held once (the lookup reads the CPU backend's fp32 head weight)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.config import LoraConfig
from lorad.server.engine.models.hf_folder import read_config, read_weights


@pytest.mark.parametrize("backend", ["torch", "ort-cpu"])
def test_tied_embedding_shares_the_fp32_head_weight(hf_dirs: dict[str, Path], backend: str) -> None:
    path = hf_dirs["llama"]
    cfg = read_config(path)
    assert cfg.tie_embeddings
    model = build_model(cfg, read_weights(path), backend=backend, lora=LoraConfig(rank=2, alpha=4))
    ref = read_weights(path)["model.embed_tokens.weight"].float()
    assert torch.equal(model.embed_tokens, ref)
    # One table: the lookup tensor is the head's own fp32 buffer (same address), no second [V, D] copy.
    frozen = model.lm_head.frozen
    held = frozen._arrays["fp32"] if backend == "ort-cpu" else frozen._store["fp32"][0]
    held_ptr = held.ctypes.data if backend == "ort-cpu" else held.data_ptr()
    assert model.embed_tokens.data_ptr() == held_ptr


def test_reduced_precision_head_keeps_an_fp16_lookup(hf_dirs: dict[str, Path]) -> None:
    path = hf_dirs["llama"]
    model = build_model(read_config(path), read_weights(path), backend="torch", precision="w8a16")
    assert model.embed_tokens.dtype == torch.float16
