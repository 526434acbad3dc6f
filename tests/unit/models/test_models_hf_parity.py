"""lorad's forward on a HF folder matches transformers' logits and loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.config import LoraConfig
from lorad.server.engine.models.hf_folder import read_config, read_weights
from tests.fixtures.tiny_hf import VOCAB


def _hf(path: Path) -> torch.nn.Module:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_logits_match_transformers(hf_dirs: dict[str, Path], arch: str) -> None:
    path = hf_dirs[arch]
    cfg = read_config(path)
    assert cfg.attn_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    model = build_model(cfg, read_weights(path), lora=LoraConfig(rank=4, alpha=8))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = _hf(path)(ids).logits
        got = model.logits(ids)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


def test_loss_and_grad_match_autograd_reference(hf_dirs: dict[str, Path]) -> None:
    path = hf_dirs["qwen2"]
    model = build_model(read_config(path), read_weights(path), lora=LoraConfig(rank=4, alpha=8))
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :10] = -100
    model.loss_chunk = 7  # several chunks, last one partial
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    loss = model(ids, labels)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    # Reference: plain full logits + F.cross_entropy through the same model's autograd.
    logits = model.logits(ids)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5), (loss, ref)
    with torch.no_grad():
        hf_loss = _hf(path)(ids, labels=labels).loss
    # Same adapter weights are not in the HF model, so only compare the loss with B = 0 there (separately below).
    assert torch.isfinite(hf_loss)
    for g, p in zip(grads, model.parameters(), strict=True):
        assert torch.allclose(g, p.grad, atol=1e-5, rtol=1e-4), (g - p.grad).abs().max()


def test_base_loss_matches_transformers(hf_dirs: dict[str, Path]) -> None:
    path = hf_dirs["llama"]
    model = build_model(read_config(path), read_weights(path), lora=LoraConfig(rank=2, alpha=4))
    ids = torch.randint(0, VOCAB, (1, 25), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :5] = -100
    with torch.no_grad():
        ref = _hf(path)(ids, labels=labels).loss
        got = model(ids, labels)
    assert abs(float(got) - float(ref)) < 1e-5


def test_lora_groups_ordered_and_state_dict_names(hf_dirs: dict[str, Path]) -> None:
    path = hf_dirs["llama"]
    lora = LoraConfig(rank=2, alpha=4, targets=("q_proj", "v_proj"))
    model = build_model(read_config(path), read_weights(path), lora=lora)
    groups = model.lora_groups()
    assert [g for g, _ in groups] == ["model.layers.0", "model.layers.1"]
    assert all(len(ps) == 4 for _, ps in groups)  # q and v, A and B each
    sd = model.lora_state_dict()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in sd
    assert sd["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (32, 2)
    sd = {k: torch.randn_like(v) for k, v in sd.items()}
    model.load_lora_state_dict(sd)
    assert all(torch.equal(v, model.lora_state_dict()[k]) for k, v in sd.items())
    with pytest.raises(KeyError, match="missing"):
        model.load_lora_state_dict({})


def test_precision_plan_sets_each_layer(hf_dirs: dict[str, Path]) -> None:
    from lorad.kernels.planner import LayerPlan, PrecisionPlan

    path = hf_dirs["llama"]
    q0 = "model.layers.0.self_attn.q_proj"
    plan = PrecisionPlan("torch", "fp32", 0.01, "bytes", {q0: LayerPlan(q0, (64, 64), "fp16", "w8a16", [])})
    model = build_model(read_config(path), read_weights(path), precision=plan, lora=LoraConfig(rank=2, alpha=4))
    f = model.layers[0].self_attn.q_proj.frozen
    assert (f.precision_fwd, f.precision_bwd) == ("fp16", "w8a16")
    assert model.layers[1].self_attn.q_proj.frozen.precision_fwd == "fp32"  # not in the plan -> reference


@pytest.mark.parametrize(("backend", "atol"), [("ort-cpu", 1e-4)])
def test_other_backend_matches_torch(hf_dirs: dict[str, Path], backend: str, atol: float) -> None:
    pytest.importorskip("onnxruntime")
    path = hf_dirs["qwen2"]
    cfg, w = read_config(path), read_weights(path)
    ref = build_model(cfg, w, lora=LoraConfig(rank=2, alpha=4))
    other = build_model(cfg, w, backend=backend, lora=LoraConfig(rank=2, alpha=4))
    other.load_lora_state_dict({k: torch.randn_like(v) * 0.1 for k, v in ref.lora_state_dict().items()})
    ref.load_lora_state_dict(other.lora_state_dict())
    ids = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    l_ref, l_other = ref(ids, labels), other(ids, labels)
    l_ref.backward()
    l_other.backward()
    assert abs(float(l_ref.detach()) - float(l_other.detach())) < atol
    for p, q in zip(ref.parameters(), other.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=atol * 10), (p.grad - q.grad).abs().max()
