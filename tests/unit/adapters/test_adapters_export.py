"""Derived exports: llama.cpp GGUF LoRA (read back with GGUFReader) and a merged model transformers loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lorad.server.engine.adapters import export_gguf_lora, export_merged
from lorad.server.engine.models.gguf_read import unpermute_qk
from tests.fixtures.tiny_adapter import Trained

IDS = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(2))


def test_gguf_lora_reads_back(trained: Trained, tmp_path: Path) -> None:
    import gguf

    cfg = trained.lm.config
    path = export_gguf_lora(trained.adapter, tmp_path / "ad.gguf", cfg)
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.type"].contents() == "adapter"
    assert r.fields["adapter.type"].contents() == "lora"
    assert r.fields["general.architecture"].contents() == cfg.arch
    assert abs(r.fields["adapter.lora.alpha"].contents() - 8.0) < 1e-6
    got = {t.name: t for t in r.tensors}
    weights = trained.adapter.weights().tensors
    assert len(got) == 2 * len(weights) == 2 * 7 * cfg.num_layers
    assert sorted(p for p in tmp_path.iterdir()) == [path]  # no temp file left
    for layer in range(cfg.num_layers):
        for short, hf in (
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("ffn_down", "mlp.down_proj"),
        ):
            a, b = weights[f"model.layers.{layer}.{hf}"]
            ta, tb = got[f"blk.{layer}.{short}.weight.lora_a"], got[f"blk.{layer}.{short}.weight.lora_b"]
            # GGUF lists ne[0] first: lora_a is [in, r], lora_b is [r, out] in GGUF order.
            assert list(ta.shape) == [a.shape[1], 4] and list(tb.shape) == [4, b.shape[0]]
            ga = np.asarray(ta.data).reshape(a.shape)
            gb = np.asarray(tb.data).reshape(b.shape)
            if cfg.arch == "llama" and short in ("attn_q", "attn_k"):
                gb = unpermute_qk(gb, cfg.num_heads if short == "attn_q" else cfg.num_kv_heads)
            assert np.array_equal(ga, a.numpy()) and np.array_equal(gb, b.numpy())


def test_llama_gguf_lora_matches_permuted_base_delta(trained: Trained, tmp_path: Path) -> None:
    """For Llama, B·A in GGUF layout must equal the permutation applied to the HF delta (as llama.cpp adds it)."""
    from lorad.server.engine.models.gguf_read import permute_qk

    cfg = trained.lm.config
    if cfg.arch != "llama":
        pytest.skip("q/k permutation applies to Llama only")
    import gguf

    r = gguf.GGUFReader(str(export_gguf_lora(trained.adapter, tmp_path / "ad.gguf", cfg)))
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    a, b = trained.adapter.weights().tensors["model.layers.0.self_attn.k_proj"]
    delta_gguf = t["blk.0.attn_k.weight.lora_b"].reshape(b.shape) @ t["blk.0.attn_k.weight.lora_a"].reshape(a.shape)
    assert np.allclose(delta_gguf, permute_qk((b @ a).numpy(), cfg.num_kv_heads), atol=1e-6)


def test_merged_model_loads_in_transformers(trained: Trained, tmp_path: Path) -> None:
    import transformers as tf

    out = export_merged(trained.lm.checkpoint.path, trained.adapter, tmp_path / "merged")
    merged = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = merged(IDS).logits
        got = trained.lm.model.logits(IDS)
        base = trained.lm.model.logits(IDS, adapter=None)
    assert (got - base).abs().max() > 1e-2
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    assert (out / "tokenizer.json").is_file()
