"""The real engine session: the base model's held-out loss is measured once, before the first step, and is exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lorad.server.domain import JobSpec, Message, Progress, Requirements, SampleBody, TrainingParams
from lorad.server.jobs.engine import EngineSession
from lorad.server.jobs.session import SessionRequest
from lorad.server.modelhost import ModelHost

from tests.fixtures.tiny_hf import save_tiny_hf


class RecordingSink:
    """Records what a session reports."""

    def __init__(self) -> None:
        self.before: list[tuple[float, int]] = []
        self.progress_steps: list[int] = []
        self.train_losses: list[float] = []
        self.notices: list[str] = []
        self.backends: list[tuple[str, str]] = []

    def backend(self, name: str, reason: str) -> None:
        self.backends.append((name, reason))

    def eval_before(self, loss: float, total_steps: int) -> None:
        self.before.append((loss, total_steps))

    def progress(self, progress: Progress, *, evaluated: bool) -> None:
        self.progress_steps.append(progress.step)
        self.train_losses.append(progress.train_loss)

    def checkpoint(self, step: int, path: Path, size_bytes: int, train_loss: float) -> None:
        pass

    def notice(self, message: str) -> None:
        self.notices.append(message)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp("m"), "llama")


def _samples(n: int = 16) -> tuple[SampleBody, ...]:
    return tuple(
        SampleBody(messages=(Message("user", f"What is note {i}?"), Message("assistant", f"Note {i} is a fox.")))
        for i in range(n)
    )


def _run(tiny: Path, work: Path, before: float | None, steps: int = 3) -> tuple[RecordingSink, Any]:
    params = TrainingParams(base_model="", rank=4, max_steps=steps, batch_size=2, seq_len=64, eval_fraction=0.3,
                            eval_every_steps=100, checkpoint_every_steps=100, dropout=0.1, learning_rate=1e-3,
                            seed=3, backend="torch", precision="fp32")  # fmt: skip
    spec = JobSpec(("ds",), params, Requirements(False, 0, 80.0, False))
    req = SessionRequest("job_x", "app", spec, _samples(), work, 2, before)
    models = ModelHost(str(tiny), (), work.parent / "cache", "torch")
    sink = RecordingSink()
    out = EngineSession(req, models, work.parent / "cache", "torch").run(lambda: False, sink)
    assert out.completed and out.adapter is not None
    return sink, out.adapter


def _base_eval_loss(tiny: Path, cache: Path) -> float:
    """Independent reference: the base model without any LoRA over the trainer's held-out batches."""
    from lorad.server.engine.models.loader import load_model
    from lorad.server.engine.training import prepare
    from lorad.server.engine.training.packing import eval_batches, target_count
    from lorad.server.jobs.engine import _training_samples

    loaded = load_model(tiny, cache_root=cache, backend="torch", precision="fp32", lora=None)
    tok = loaded.tokenizer
    data = prepare(_training_samples(_samples()), tok, seq_len=64, eval_fraction=0.3)
    batches = eval_batches(data.eval, seq_len=64, batch_size=2, pad_id=tok.eos_id or 0, max_batches=10_000)
    num = den = 0.0
    with torch.no_grad():
        for x, y in batches:
            n = target_count(y)
            num += float(loaded.model(x, y)) * n
            den += n
    return num / den


def test_loss_before_is_the_base_models_and_reaches_the_adapter(tiny: Path, tmp_path: Path) -> None:
    sink, art = _run(tiny, tmp_path / "a", None)
    assert len(sink.before) == 1, "measured exactly once"
    loss, total = sink.before[0]
    assert total == 3
    # The trainer caps held-out batches (cfg.eval_batches); the tiny set is far below that cap.
    assert loss == pytest.approx(_base_eval_loss(tiny, tmp_path / "cache"), rel=1e-5)
    assert art.eval_loss_before == loss
    assert art.eval_loss_after < loss, "a few steps on the data lower the held-out loss"


def test_a_stored_loss_before_is_not_measured_again_and_measuring_leaves_training_unchanged(
    tiny: Path, tmp_path: Path
) -> None:
    measured, _ = _run(tiny, tmp_path / "a", None)
    stored, art = _run(tiny, tmp_path / "b", 1.25)
    assert stored.before == []
    assert art.eval_loss_before == 1.25
    # Dropout draws from torch's global RNG: measuring must not shift the training trajectory.
    assert measured.train_losses == stored.train_losses
