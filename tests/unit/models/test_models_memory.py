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


@pytest.mark.parametrize(("backend", "precision"), [("torch", "fp32"), ("torch", "bf16"), ("torch", "w8a8"),
                                                    ("ort-cpu", "fp32"), ("ort-cpu", "w8a8")])  # fmt: skip
def test_weights_stored_in_bf16_build_the_model_their_fp32_values_build(
    hf_dirs: dict[str, Path], backend: str, precision: str
) -> None:
    """The build hands each weight to the backend as stored (no full-size fp32 copy first): a bf16 checkpoint gives
    bit for bit the model that the same values stored as fp32 give."""
    path = hf_dirs["qwen2"]  # biases too
    cfg = read_config(path)
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in read_weights(path).items()}
    as_fp32 = {k: v.float() for k, v in as_bf16.items()}

    def run(weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = build_model(cfg, weights, backend=backend, precision=precision, lora=LoraConfig(rank=2, alpha=4))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
        ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
        loss = model(ids, ids)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]  # type: ignore[misc]

    (loss_a, grads_a), (loss_b, grads_b) = run(as_bf16), run(as_fp32)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert all(v.dtype == torch.bfloat16 for v in as_bf16.values())  # the caller's tensors were not converted
