"""Tiny Llama and Qwen2 with every projection as a lorad LoRALinear match plain torch.autograd (loss, dA, dB)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lorad.kernels import LoRALinear, make_frozen_linear
from tests.fixtures.tiny_reference import PlainLoRA, TinyCausalLM, TinyConfig, lm_loss, random_weights

RANK, ALPHA = 4, 8.0


def _lora_grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}


def run_pair(cfg: TinyConfig, backend: str, precision: str, buckets: tuple[int, ...] = (64, 128)):
    """Loss and LoRA grads of the lorad model and the plain reference, same weights and same LoRA values."""
    weights = random_weights(cfg)
    ref = TinyCausalLM(cfg, weights, lambda n, w, b, r: PlainLoRA(w, b, r, ALPHA), RANK)

    def lorad_factory(name: str, w: Tensor, b: Tensor | None, rank: int) -> nn.Module:
        fl = make_frozen_linear(w, b, backend=backend, precision=precision, name=name, buckets=buckets)
        return LoRALinear(fl, rank, ALPHA)

    ours = TinyCausalLM(cfg, weights, lorad_factory, RANK)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for (n, p_ref), (n2, p) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
            assert n == n2
            p_ref.copy_(torch.randn(p.shape, generator=g) * 0.1)  # nonzero B so dA flows
            p.copy_(p_ref)
    ids = torch.randint(0, cfg.vocab, (2, 9), generator=g)
    losses = []
    for m in (ref, ours):
        loss = lm_loss(m, ids)
        loss.backward()
        losses.append(loss.detach())
    return losses, _lora_grads(ref), _lora_grads(ours)


def assert_grads_close(g_ref: dict[str, Tensor], g: dict[str, Tensor], rtol: float) -> None:
    assert g_ref.keys() == g.keys() and len(g) == 2 * 2 * 7
    worst = 0.0
    for n, ref in g_ref.items():
        rel = ((g[n] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        worst = max(worst, rel)
        assert rel <= rtol, f"{n}: relative error {rel:.3e} > {rtol:.1e}"
    print(f"worst relative LoRA-grad error {worst:.3e}")


@pytest.mark.parametrize("backend", ["torch", "ort-cpu"])
@pytest.mark.parametrize("qwen", [False, True], ids=["llama", "qwen2"])
def test_tiny_model_fp32_matches_autograd(backend: str, qwen: bool) -> None:
    cfg = TinyConfig(qkv_bias=qwen)
    (l_ref, l_ours), g_ref, g = run_pair(cfg, backend, "fp32")
    torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(g_ref, g, rtol=1e-4)


def test_tiny_model_w8a8_ort_close_to_autograd() -> None:
    (l_ref, l_ours), g_ref, g = run_pair(TinyConfig(qkv_bias=True), "ort-cpu", "w8a8")
    assert abs(l_ours.item() - l_ref.item()) / l_ref.item() < 2e-2
    assert_grads_close(g_ref, g, rtol=0.15)


@pytest.mark.htp
@pytest.mark.parametrize("qwen", [False, True], ids=["llama", "qwen2"])
def test_tiny_model_htp_fp16_matches_autograd(htp_available: None, qwen: bool) -> None:
    (l_ref, l_ours), g_ref, g = run_pair(TinyConfig(qkv_bias=qwen), "qnn-htp", "fp16", buckets=(32,))
    torch.testing.assert_close(l_ours, l_ref, rtol=2e-3, atol=1e-4)
    assert_grads_close(g_ref, g, rtol=2e-2)
