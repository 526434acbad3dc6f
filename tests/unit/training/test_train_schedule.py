"""LR schedule values at known points."""

import math

import pytest

from lorad.server.engine.training.schedule import lr_at


def test_warmup_then_cosine() -> None:
    kw = {"lr": 1e-3, "steps": 110, "warmup_steps": 10, "schedule": "cosine"}
    assert lr_at(0, **kw) == 0.0
    assert lr_at(5, **kw) == pytest.approx(5e-4)
    assert lr_at(10, **kw) == pytest.approx(1e-3)
    assert lr_at(60, **kw) == pytest.approx(5e-4)  # half-way through the decay
    assert lr_at(35, **kw) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr_at(110, **kw) == pytest.approx(0.0, abs=1e-12)


def test_linear_and_floor_and_constant() -> None:
    assert lr_at(55, lr=1.0, steps=100, warmup_steps=10, schedule="linear") == pytest.approx(0.5)
    assert lr_at(100, lr=1.0, steps=100, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_at(50, lr=1.0, steps=100, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(0.55)
    assert lr_at(99, lr=0.3, steps=100, warmup_steps=4, schedule="constant") == 0.3


def test_matches_transformers() -> None:
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-4)
    sched = tf.get_cosine_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=20)
    for step in range(20):
        assert opt.param_groups[0]["lr"] == pytest.approx(
            lr_at(step, lr=2e-4, steps=20, warmup_steps=3, schedule="cosine"), rel=1e-12, abs=1e-15
        )
        opt.step()
        sched.step()


def test_bad_schedule() -> None:
    with pytest.raises(ValueError, match="schedule='x'"):
        lr_at(5, lr=1.0, steps=10, warmup_steps=0, schedule="x")
