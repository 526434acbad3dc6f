"""Trailing padding is not computed: the trimmed batch gives the whole batch's loss and adapter gradients, on the real
model and both CPU backends, and the trainer feeds the model trimmed batches in training and in evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorad.server.engine.api import LoraConfig, load_model
from lorad.server.engine.training.config import TrainConfig
from lorad.server.engine.training.packing import IGNORE, TRIM_MULTIPLE, trim_tail
from tests.fixtures.tiny_hf import save_tiny_hf
from tests.fixtures.tiny_lm import make_trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp("hf"), "llama", seed=2)


def _loss_and_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("backend", ["torch", "ort-cpu"])
def test_trimmed_batch_has_the_whole_batchs_loss_and_gradients(tiny: Path, tmp_path: Path, backend: str) -> None:
    loaded = load_model(tiny, cache_root=tmp_path, backend=backend, precision="fp32", lora=LoraConfig(rank=4, alpha=8))
    model = loaded.model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B = 0 at init would leave A without a gradient to compare
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    x = torch.randint(0, 64, (2, 64), generator=g)
    y = x.clone()
    y[0, 38:] = IGNORE  # row 0's last label at 37, row 1's at 20, padding after both
    y[1, 21:] = IGNORE
    y[:, :3] = IGNORE
    xt, yt = trim_tail(x, y)
    assert xt.shape == (2, 48)
    full_loss, full = _loss_and_grads(model, x, y)
    cut_loss, cut = _loss_and_grads(model, xt, yt)
    assert cut_loss == pytest.approx(full_loss, rel=1e-6)
    assert full.keys() == cut.keys() and len(full) > 0
    for n in full:
        assert full[n].abs().max() > 0, n
        torch.testing.assert_close(cut[n], full[n], rtol=1e-4, atol=1e-6, msg=n)


def test_trainer_feeds_the_model_trimmed_batches() -> None:
    cfg = TrainConfig(steps=8, seq_len=64, batch_size=1, lr=1e-2, warmup_steps=1, eval_fraction=0.3, eval_every=4)
    t = make_trainer(cfg)
    seen: list[tuple[bool, int, int]] = []  # (training, positions fed, positions up to the last label + 1)

    def record(_m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x, y = args[0], args[1]
        last = int((y != IGNORE).any(dim=0).nonzero()[-1]) + 1
        seen.append((t.model.training, int(x.shape[1]), last))

    hook = t.model.register_forward_pre_hook(record)
    t.run()
    hook.remove()
    t.close()
    for training in (True, False):
        fed = [(n, last) for tr, n, last in seen if tr is training]
        assert fed, f"no {'training' if training else 'eval'} batches seen"
        assert all(last <= n <= 64 and (n % TRIM_MULTIPLE == 0 or n == 64) for n, last in fed), fed
        assert all(n - last < TRIM_MULTIPLE for n, last in fed), fed
        assert any(n < 64 for n, _ in fed), f"no {'training' if training else 'eval'} batch was trimmed: {fed}"
