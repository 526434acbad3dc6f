"""The bundle model builder: the layout from build_model, every frozen projection from the prepared linears."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorad.kernels import make_frozen_linear
from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.config import LoraConfig
from lorad.server.engine.models.hf_folder import read_config, read_weights
from lorad.server.engine.models.model import Linear
from lorad.server.qnn_bundle import assemble
from tests.fixtures.tiny_hf import save_tiny_hf


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
    lora = LoraConfig(rank=2, alpha=4.0, dropout=0.0, targets=("q_proj", "v_proj"))
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


@pytest.mark.htp
def test_daemon_builds_the_default_model_from_a_real_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lorad.kernels.qnn_htp import htp_unavailable_reason
    from lorad.server.engine.prepare import prepare_main
    from lorad.server.modelhost import ModelEntry
    from lorad.server.qnn_bundle import bundle_loader, open_bundle

    if reason := htp_unavailable_reason():
        pytest.skip(f"QNN HTP EP unavailable: {reason}")
    folder = save_tiny_hf(tmp_path / "m", "llama")
    bundle = tmp_path / "bundle"
    assert prepare_main(["--model", str(folder), "--soc", "8 Gen 3", "--out", str(bundle), "--bucket", "32"]) == 0
    # The simulator stands in for the phone: it reports the bundle's SoC through the kernels' override.
    monkeypatch.setenv("LORAD_QNN_SOC_MODEL", "57")
    monkeypatch.setenv("LORAD_QNN_HTP_ARCH", "75")
    pb = open_bundle(str(bundle), ModelEntry("m", folder, True), tmp_path / "cache")
    load = bundle_loader(pb)
    lora = LoraConfig(rank=2, alpha=4.0, dropout=0.0, targets=("q_proj", "v_proj"))
    loaded = load(folder, cache_root=tmp_path / "cache", backend="qnn-htp", precision="fp16", lora=lora)
    assert loaded.model.embed_tokens.dtype == torch.float16, "fp16 head: the lookup table is kept in fp16"
    lins = [m.frozen for m in loaded.model.modules() if isinstance(m, Linear)]
    assert lins and all(set(lin.sources.values()) <= {"cache", "shared"} for lin in lins), "nothing was built"
    cfg, weights = read_config(folder), read_weights(folder)
    ref = build_model(cfg, weights, backend="torch", precision="fp32", lora=None)
    x = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        got, want = loaded.model(x, x), ref(x, x)
    assert abs(float(got) - float(want)) / float(want) < 5e-3, (float(got), float(want))  # fp16 graphs
    loss = loaded.model(x, x)
    loss.backward()  # the input gradients run on the bundle's bwd graphs
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in loaded.model.parameters())
    # Another backend asked for explicitly loads as usual, without the bundle.
    plain = load(folder, cache_root=tmp_path / "cache", backend="torch", precision="fp32", lora=None)
    assert not any(hasattr(m.frozen, "sources") for m in plain.model.modules() if isinstance(m, Linear))
