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


def _stored(folder: Path) -> set[torch.dtype]:
    from lorad.server.engine.models.hf_folder import read_weights

    w = read_weights(folder)
    return {w.stored_dtype(k) for k in w}


def test_merged_export_keeps_a_16_bit_base_precision(trained: Trained, tmp_path: Path) -> None:
    import json
    import shutil

    import transformers as tf
    from safetensors.torch import load_file, save_file

    bf16 = tmp_path / "bf16-base"
    shutil.copytree(trained.hf_dir, bf16)
    for f in bf16.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    out = export_merged(bf16, trained.adapter, tmp_path / "merged")
    assert _stored(out) == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    merged = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = merged(IDS).logits
    assert torch.allclose(trained.lm.model.logits(IDS), ref, atol=0.1), "the adapter is in the bf16 weights"


def test_merged_export_of_a_gguf_base_is_fp16_and_half_the_fp32_size(trained: Trained, tmp_path: Path) -> None:
    from lorad.server.engine.models.loader import resolve
    from tests.fixtures.tiny_hf import write_tiny_gguf

    ck = resolve(write_tiny_gguf(trained.hf_dir, tmp_path / "base.gguf"), tmp_path / "cache")
    assert _stored(ck.path) == {torch.float32}, "precondition: the converted GGUF is stored dequantized as fp32"
    out = export_merged(ck.path, trained.adapter, tmp_path / "merged")
    assert _stored(out) == {torch.float16}
    fp32_size = sum(f.stat().st_size for f in ck.path.glob("*.safetensors"))
    assert (out / "model.safetensors").stat().st_size < 0.55 * fp32_size
