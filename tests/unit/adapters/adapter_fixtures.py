"""Builds a tiny HF base, loads it into lorad and gives it a random nonzero adapter."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

# The tiny-model builders live with the model tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from lorad.server.engine.adapters import Adapter, AdapterMetadata
from lorad.server.engine.models import LoadedModel, LoraConfig, load_model
from tiny_models import save_tiny_hf


@dataclass
class Trained:
    """A base folder, the lorad model on it with a random adapter, and that adapter."""

    hf_dir: Path
    lm: LoadedModel
    adapter: Adapter


def make_trained(
    root: Path, arch: str, targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
) -> Trained:
    hf = save_tiny_hf(root, arch, seed=11)
    lm = load_model(hf, cache_root=root / "cache", lora=LoraConfig(rank=4, alpha=8.0, targets=targets))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in lm.model.parameters():  # B = 0 at init would make the test blind; randomise A and B
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    meta = AdapterMetadata(
        base_model_hash=lm.model_hash,
        tokenizer_hash=lm.tokenizer_hash,
        rank=4,
        alpha=8.0,
        targets=targets,
        arch=lm.config.arch,
        data_window={"samples": 3},
        steps=5,
        metrics={"train_loss": 1.5},
    )
    return Trained(hf, lm, Adapter.from_model(lm.model, meta))
