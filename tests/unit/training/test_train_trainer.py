"""Trainer loop: progress reports, eval at intervals, pause at a step boundary, in-process resume."""

import itertools
from pathlib import Path

import pytest
import torch

from lorad.server.engine.training import checkpoint as ckpt
from lorad.server.engine.training.config import TrainConfig
from lorad.server.engine.training.packing import BatchStream
from lorad.server.engine.training.trainer import Progress
from tests.fixtures.tiny_lm import EOS, make_trainer

CFG = TrainConfig(
    steps=6, seq_len=32, batch_size=2, lr=1e-2, warmup_steps=1, eval_fraction=0.2, eval_every=2, dropout=0.1, seed=3
)


def test_progress_eval_and_learning() -> None:
    seen: list[Progress] = []
    t = make_trainer(CFG, on_progress=seen.append)
    first_eval = t.evaluate()
    r = t.run()
    t.close()
    assert r.status == "completed" and r.step == 6 and len(r.losses) == 6
    assert [p.step for p in seen] == [1, 2, 3, 4, 5, 6]
    assert seen[0].lr == 0.0 and seen[1].lr == pytest.approx(1e-2)  # warm-up step 0 runs at lr 0
    assert all(p.total_steps == 6 and p.tokens_per_s > 0 and p.eta_s >= 0 for p in seen)
    assert seen[-1].eta_s == 0.0
    assert [s for s, _ in r.eval_losses] == [2, 4, 6]
    assert [p.eval_loss is not None for p in seen] == [False, True, False, True, False, True]
    assert first_eval is not None and r.eval_losses[-1][1] < first_eval
    # Tokens are the samples' own, padding excluded: those of the batches the same stream gives, step by step.
    stream = BatchStream(t.data.train, seq_len=32, batch_size=2, seed=3, pad_id=EOS)
    per_step = [stream.next_batch().tokens for _ in range(6)]
    assert r.tokens == per_step and [p.tokens_seen for p in seen] == list(itertools.accumulate(per_step))
    assert seen[-1].tokens_seen < 6 * CFG.tokens_per_step  # the corpus packs with padding at sequence ends


def test_pause_at_step_boundary_then_resume_matches(tmp_path: Path) -> None:
    straight = make_trainer(CFG)
    ref = straight.run()
    straight.close()

    steps: list[int] = []
    seen: list[Progress] = []
    t = make_trainer(CFG, tmp_path, on_progress=lambda p: steps.append(p.step), should_pause=lambda: len(steps) >= 2)
    r = t.run()
    t.close()
    assert r.status == "paused" and r.step == 2 and r.checkpoint is not None
    assert [i.step for i in ckpt.list_checkpoints(tmp_path)] == [2]

    torch.manual_seed(999)  # a resumed run must not depend on the RNG state it starts with
    t2 = make_trainer(CFG, tmp_path, on_progress=seen.append)
    t2.restore(r.checkpoint)
    r2 = t2.run()
    t2.close()
    assert r2.status == "completed" and r2.losses == ref.losses and r2.eval_losses == ref.eval_losses
    assert r2.tokens == ref.tokens and seen[-1].tokens_seen == sum(ref.tokens)  # counted across the pause
    a, b = straight.model.lora_state_dict(), t2.model.lora_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [i.step for i in ckpt.list_checkpoints(tmp_path)] == [2, 6]


def test_a_checkpoint_from_before_token_counts_resumes_counting_full_sequences(tmp_path: Path) -> None:
    steps: list[int] = []
    t = make_trainer(CFG, tmp_path, on_progress=lambda p: steps.append(p.step), should_pause=lambda: len(steps) >= 2)
    r = t.run()
    t.close()
    assert r.checkpoint is not None
    state = torch.load(r.checkpoint, weights_only=True)
    del state["history"]["tokens"]  # what a checkpoint written before tokens were counted holds
    torch.save(state, r.checkpoint)
    seen: list[Progress] = []
    t2 = make_trainer(CFG, tmp_path, on_progress=seen.append)
    t2.restore(r.checkpoint)
    r2 = t2.run()
    t2.close()
    assert r2.status == "completed" and r2.tokens[:2] == [CFG.tokens_per_step] * 2
    assert seen[-1].tokens_seen == 2 * CFG.tokens_per_step + sum(r2.tokens[2:])
