"""Subprocess worker for the exact-resume test: runs TinyLM training straight, to a pause, or from a checkpoint."""

import json
import sys
from pathlib import Path

import torch

from lorad.server.engine.training import checkpoint as ckpt
from lorad.server.engine.training.config import TrainConfig
from tests.fixtures.tiny_lm import make_trainer

CFG = TrainConfig(
    steps=8,
    seq_len=32,
    batch_size=2,
    grad_accum=2,
    lr=5e-3,
    warmup_steps=2,
    dropout=0.1,
    weight_decay=0.01,
    max_grad_norm=1.0,
    clip_mode="per_layer",
    eval_fraction=0.2,
    eval_every=3,
    seed=11,
)


def main(mode: str, ckpt_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    paused_at = CFG.steps // 2
    done: list[int] = []
    if mode == "half":
        t = make_trainer(
            CFG, Path(ckpt_dir), on_progress=lambda p: done.append(p.step), should_pause=lambda: len(done) >= paused_at
        )
    else:
        t = make_trainer(CFG, Path(ckpt_dir))
    if mode == "resume":
        info = ckpt.latest(Path(ckpt_dir))
        assert info is not None and info.step == paused_at, info
        t.restore(info.path)
    r = t.run()
    t.close()
    torch.save(t.model.lora_state_dict(), out + ".pt")
    Path(out + ".json").write_text(
        json.dumps({"status": r.status, "step": r.step, "losses": r.losses, "eval": r.eval_losses})
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
