"""PEFT-format adapters: PEFT reads lorad's adapter with the same logits; lorad reads PEFT's; base checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lorad.server.engine.adapters import (
    AdapterBaseMismatchError,
    AdapterMetadata,
    apply_adapter,
    load_adapter,
    save_adapter,
)
from lorad.server.engine.models.config import LoraConfig
from lorad.server.engine.models.loader import load_model
from tests.fixtures.tiny_adapter import Trained, make_trained

IDS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(9))
ATOL = 1e-4  # fp32 on both sides; observed max |diff| ~1e-6


def _hf(path: Path) -> torch.nn.Module:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_peft_loads_lorad_adapter_same_logits(trained: Trained, tmp_path: Path) -> None:
    from peft import PeftModel

    out = save_adapter(tmp_path / "ad", trained.adapter, base_name_or_path=str(trained.hf_dir))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and "q_proj" in cfg["target_modules"]
    peft_model = PeftModel.from_pretrained(_hf(trained.hf_dir), str(out)).eval()
    with torch.no_grad():
        ref = peft_model(IDS).logits
        got = trained.lm.model.logits(IDS)
        base = trained.lm.model.logits(IDS, adapter=None)
    assert (got - base).abs().max() > 1e-2  # the adapter really changes the output
    assert torch.allclose(got, ref, atol=ATOL), (got - ref).abs().max()


def test_lorad_loads_peft_adapter(tmp_path: Path) -> None:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    t = make_trained(tmp_path, "llama", targets=("q_proj", "v_proj", "down_proj"))
    pm = get_peft_model(
        _hf(t.hf_dir), PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    pm.save_pretrained(tmp_path / "peft_ad")
    ad = load_adapter(tmp_path / "peft_ad")
    assert ad.metadata is None and ad.lora.targets == ("q_proj", "v_proj", "down_proj")
    apply_adapter(t.lm.model, ad, model_hash=t.lm.model_hash, tokenizer_hash=t.lm.tokenizer_hash)
    with torch.no_grad():
        ref = pm.eval()(IDS).logits
        assert torch.allclose(t.lm.model.logits(IDS), ref, atol=ATOL)
        assert torch.allclose(t.lm.model.logits(IDS, adapter=ad.weights()), ref, atol=ATOL)


def test_round_trip_keeps_tensors_and_metadata(trained: Trained, tmp_path: Path) -> None:
    save_adapter(tmp_path / "ad", trained.adapter)
    back = load_adapter(tmp_path / "ad")
    assert back.metadata == trained.adapter.metadata
    assert back.lora == LoraConfig(rank=4, alpha=8.0)
    assert set(back.tensors) == set(trained.adapter.tensors)
    assert all(torch.equal(back.tensors[k], v) for k, v in trained.adapter.tensors.items())
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ad" / "adapter_model.safetensors"), framework="pt") as sf:
        assert sf.metadata()["lorad_base_model_hash"] == trained.lm.model_hash


def test_refuses_other_base(trained: Trained, tmp_path: Path) -> None:
    other = make_trained(tmp_path, "llama" if trained.lm.config.arch != "llama" else "qwen2")
    save_adapter(tmp_path / "ad", trained.adapter)
    ad = load_adapter(tmp_path / "ad")
    with pytest.raises(AdapterBaseMismatchError) as e:
        apply_adapter(other.lm.model, ad, model_hash=other.lm.model_hash, tokenizer_hash=other.lm.tokenizer_hash)
    assert trained.lm.model_hash[:16] in str(e.value) and other.lm.model_hash[:16] in str(e.value)
    with pytest.raises(AdapterBaseMismatchError, match="tokenizer"):
        ad.check_base(trained.lm.model_hash, "f" * 64)
    ad.check_base(trained.lm.model_hash, trained.lm.tokenizer_hash)  # the right base passes


def test_same_weights_different_folder_same_hash(trained: Trained, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(trained.hf_dir, copy)
    lm2 = load_model(copy, cache_root=tmp_path / "cache")
    assert lm2.model_hash == trained.lm.model_hash and lm2.tokenizer_hash == trained.lm.tokenizer_hash


def test_save_replaces_atomically_and_leaves_no_temp(trained: Trained, tmp_path: Path) -> None:
    dest = tmp_path / "ad"
    save_adapter(dest, trained.adapter)
    newer = type(trained.adapter)(
        trained.adapter.lora, {k: v + 1 for k, v in trained.adapter.tensors.items()}, trained.adapter.metadata
    )
    save_adapter(dest, newer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad"]
    k = next(iter(newer.tensors))
    assert torch.equal(load_adapter(dest).tensors[k], newer.tensors[k])


def test_a_save_that_fails_midway_leaves_the_old_adapter_and_no_half_folder(
    trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors reports a full disk as its own error after part of the file is written: the half-built folder must
    go at once, or it keeps holding the space a job waiting for disk needs."""
    import lorad.server.engine.adapters.peft_io as peft_io

    dest = tmp_path / "ad"
    save_adapter(dest, trained.adapter)

    def full_disk(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(b"part of the weights")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(peft_io, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_adapter(dest, trained.adapter)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad"]
    k = next(iter(trained.adapter.tensors))
    assert torch.equal(load_adapter(dest).tensors[k], trained.adapter.tensors[k])


def test_metadata_requires_fields() -> None:
    with pytest.raises(ValueError, match="base_model_hash"):
        AdapterMetadata.from_json({"rank": 1})


def test_unsupported_peft_features_listed(trained: Trained, tmp_path: Path) -> None:
    d = save_adapter(tmp_path / "ad", trained.adapter)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg |= {"use_dora": True, "target_modules": "q_proj|v_proj"}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"use_dora.*regex"):
        load_adapter(d)
