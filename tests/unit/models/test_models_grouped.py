"""A whole tiny model trains the same whether q/k/v and the MLP run as grouped nodes or layer by layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorad.server.engine.models import model as model_mod
from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.config import LoraConfig
from lorad.server.engine.models.hf_folder import read_config, read_weights


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_grouped_nodes_give_the_layer_by_layer_gradients(
    hf_dirs: dict[str, Path], arch: str, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = hf_dirs[arch]

    def build(precision: str) -> model_mod.CausalLM:
        model = build_model(read_config(path), read_weights(path), backend="torch", precision=precision,
                            lora=LoraConfig(rank=4, alpha=8))  # fmt: skip
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(std=0.05, generator=g)  # B starts at zero: make every LoRA path carry gradient
        return model

    model = build(precision)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))
    calls = {"group": 0, "mlp": 0}
    real_group, real_mlp = model_mod.shared_input_lora, model_mod.lora_swiglu

    def count(kind: str, fn):  # type: ignore[no-untyped-def]
        def wrapped(*a):  # type: ignore[no-untyped-def]
            calls[kind] += 1
            return fn(*a)

        return wrapped

    monkeypatch.setattr(model_mod, "shared_input_lora", count("group", real_group))
    monkeypatch.setattr(model_mod, "lora_swiglu", count("mlp", real_mlp))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = model(ids, ids)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]

    loss_g, grouped = run()
    assert calls == {"group": model.cfg.num_layers, "mlp": model.cfg.num_layers}
    monkeypatch.setattr(model_mod, "groupable", lambda _m: False)
    monkeypatch.setattr(model_mod, "fusable", lambda *_m: False)
    loss_s, separate = run()
    torch.testing.assert_close(loss_g, loss_s, rtol=1e-5, atol=1e-6)  # the forward is the same math
    if precision == "fp32":
        rel = float((grouped - separate).norm() / separate.norm())
        assert rel < 1e-5, rel  # the same math; only fp32 summation order differs
        return
    # At bf16 the grouped nodes multiply stacked weights (torch_backend.joint_bf16): q/k/v's (and gate/up's) input
    # gradients are summed inside one GEMM and rounded to bf16 once instead of once per layer. Both are as close to
    # the fp32 model's gradients (measured: 4.5e-3 to 8.8e-3 relative, either way).
    model = build("fp32")  # run() multiplies this model now; grouped nodes again (fp32: the same math)
    monkeypatch.undo()
    _, exact = run()

    def err(g: torch.Tensor) -> float:
        return float((g - exact).norm() / exact.norm())

    assert err(grouped) < 2e-2, err(grouped)
    assert err(grouped) < 1.25 * err(separate), (err(grouped), err(separate))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("node", ["mlp", "qkv"])
def test_a_node_in_one_kernel_call_a_direction_gives_its_python_compositions_bits(
    hf_dirs: dict[str, Path], arch: str, node: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the fused kernels run, a bf16 MLP node (``fused.lora_mlp_forward``) and a bf16 q/k/v node
    (``fused.lora_group_forward``, q/k/v biases included: qwen2) are one kernel call a direction: the same kernels and
    GEMMs in the same order as the node's Python composition, so the loss and every gradient are the same bits; an
    fp32 model never takes them."""
    from lorad.kernels import fused, lora_group
    from lorad.server.engine.models import mlp

    if fused.kernels() is None:
        pytest.skip(f"fused kernels not built here: {fused.describe()[1]}")
    path = hf_dirs[arch]
    mod, entry, switch = (mlp, "lora_mlp_forward", "_one_call_weights") if node == "mlp" else (
        lora_group, "lora_group_forward", "one_call_weight")  # fmt: skip
    calls = {"n": 0}
    real = getattr(mod, entry)

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(mod, entry, counted)

    def run(precision: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = build_model(read_config(path), read_weights(path), backend="torch", precision=precision,
                            lora=LoraConfig(rank=4, alpha=8))  # fmt: skip
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(std=0.05, generator=g)
        ids = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(6))
        loss = model(ids, ids)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]  # type: ignore[misc]

    loss_one, grads_one = run("bf16")
    layers = read_config(path).num_layers
    assert calls["n"] == layers
    monkeypatch.setattr(mod, switch, lambda *_a: None)
    loss_py, grads_py = run("bf16")
    assert calls["n"] == layers
    assert torch.equal(loss_one, loss_py)
    assert all(torch.equal(a, b) for a, b in zip(grads_one, grads_py, strict=True))
    monkeypatch.undo()
    monkeypatch.setattr(mod, entry, counted)
    run("fp32")
    assert calls["n"] == layers
