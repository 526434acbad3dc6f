"""The bundle model builder: the layout from build_model, every frozen projection from the prepared linears."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lorad.kernels import make_frozen_linear
from lorad.server.models.build import build_model
from lorad.server.models.config import LoraConfig
from lorad.server.models.hf_folder import read_config, read_weights
from lorad.server.models.model import Linear
from lorad.server.qnn_bundle import assemble

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_models import save_tiny_hf


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_assembled_model_uses_the_given_linears_and_matches_build_model(tmp_path: Path, tie: bool) -> None:
    folder = save_tiny_hf(tmp_path, "llama", tie=tie)
    cfg, weights = read_config(folder), read_weights(folder)
    ref = build_model(cfg, weights, backend="torch", precision="fp32", lora=None)
    names = [m.name for m in ref.modules() if isinstance(m, Linear)]
    src = {n: (weights["model.embed_tokens.weight"] if n == "lm_head" and "lm_head.weight" not in weights
               else weights[n + ".weight"]) for n in names}  # fmt: skip
    linears = {
        n: make_frozen_linear(w.float(), weights.get(n + ".bias"), backend="torch", precision="fp32", name=n)
        for n, w in src.items()
    }
    lora = LoraConfig(rank=2, alpha=4.0, dropout=0.0, targets=("q", "v"))
    model = assemble(cfg, weights, linears, lora)
    for m in model.modules():
        if isinstance(m, Linear):
            assert m.frozen is linears[m.name] and m.lora.frozen is linears[m.name], m.name
    assert all(p.device.type == "cpu" for p in model.parameters()) and sum(p.numel() for p in model.parameters())
    x = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        # A fresh adapter has B = 0, so the assembled model computes exactly the base model.
        torch.testing.assert_close(model(x, x), ref(x, x))


def test_a_missing_linear_is_an_error(tmp_path: Path) -> None:
    folder = save_tiny_hf(tmp_path, "llama")
    cfg, weights = read_config(folder), read_weights(folder)
    with pytest.raises(ValueError, match="no prepared linear"):
        assemble(cfg, weights, {}, None)
