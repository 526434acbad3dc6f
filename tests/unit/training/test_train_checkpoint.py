"""Atomic checkpoint writes, listing, validation, and exact resumption in a new process."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lorad.server.engine.training import checkpoint as ckpt
from lorad.server.engine.training.config import TrainConfig
from tests.fixtures.tiny_lm import make_trainer

REPO = Path(__file__).resolve().parents[3]  # subprocesses import the `tests` package from here
CFG = TrainConfig(steps=6, seq_len=32, lr=5e-3, eval_fraction=0.0, keep_checkpoints=2, dropout=0.1)


def _trained(tmp_path: Path, steps: int) -> object:
    t = make_trainer(CFG, tmp_path)
    for _ in range(steps):
        t.train_step()
    return t


def test_save_list_prune_and_load(tmp_path: Path) -> None:
    t = _trained(tmp_path, 0)
    for _ in range(3):
        t.train_step()
        t.save_checkpoint()
    infos = ckpt.list_checkpoints(tmp_path)
    assert [i.step for i in infos] == [2, 3]  # keep_checkpoints=2 pruned step 1
    state = ckpt.load(infos[-1].path)
    assert state["step"] == 3 and state["cursor"] == t.stream.cursor
    assert set(state["adapter"]) == set(t.model.lora_state_dict())
    t.close()


def test_crash_between_write_and_rename_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = _trained(tmp_path, 1)
    good = t.save_checkpoint()
    before = good.read_bytes()
    t.train_step()

    def boom(self: Path, target: Path) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(Path, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        t.save_checkpoint()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]  # no partial or temp file
    assert good.read_bytes() == before and ckpt.load(good)["step"] == 1
    t.close()


def test_kill_mid_write_leaves_only_hidden_temp(tmp_path: Path) -> None:
    code = f"""
import os
from dataclasses import replace
from pathlib import Path
from typing import Any
from tests.fixtures.tiny_lm import make_trainer
from lorad.server.engine.training.config import TrainConfig
t = make_trainer(TrainConfig(steps=6, seq_len=32, eval_fraction=0.0), Path({str(tmp_path)!r}))
t.train_step(); t.save_checkpoint(); t.train_step()
Path.replace = lambda self, target: os._exit(9)  # die like kill -9 after the temp file is written and fsynced
t.save_checkpoint()
"""
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 9, p.stderr
    names = sorted(x.name for x in tmp_path.iterdir())
    assert names[-1] == "step-00000001.pt" and len(names) == 2 and names[0].startswith(".tmp-step-00000002.pt")
    assert [i.step for i in ckpt.list_checkpoints(tmp_path)] == [1]
    assert ckpt.load(tmp_path / "step-00000001.pt")["step"] == 1
    assert ckpt.remove_stale_temps(tmp_path) == 1
    assert [x.name for x in tmp_path.iterdir()] == ["step-00000001.pt"]


def test_load_validates(tmp_path: Path) -> None:
    t = _trained(tmp_path, 1)
    path = t.save_checkpoint()
    t.close()
    other = make_trainer(TrainConfig(steps=6, seq_len=32, lr=1e-3, eval_fraction=0.0, dropout=0.1, rank=2))
    with pytest.raises(ckpt.CheckpointError) as ei:
        other.restore(path)
    msg = str(ei.value)
    assert "config lr" in msg and "config rank" in msg and "adapter tensors differ" in msg
    other.close()
    changed = make_trainer(CFG, n_samples=61)
    with pytest.raises(ckpt.CheckpointError, match="data_fingerprint"):
        changed.restore(path)
    changed.close()
    bad = tmp_path / "step-00000009.pt"
    bad.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match="cannot read"):
        ckpt.load(bad)
    renamed = tmp_path / "step-00000007.pt"
    renamed.write_bytes(path.read_bytes())
    with pytest.raises(ckpt.CheckpointError, match="name says 7"):
        ckpt.load(renamed)


def test_rng_roundtrip() -> None:
    import random

    import numpy as np

    s = ckpt.capture_rng()
    a = (torch.rand(3), random.random(), np.random.rand())
    ckpt.restore_rng(s)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def _worker(mode: str, ckpt_dir: Path, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "tests.unit.training.train_resume_worker", mode, str(ckpt_dir), str(out)],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(Path(str(out) + ".json").read_text())


@pytest.mark.integration
def test_exact_resume_in_new_process(tmp_path: Path) -> None:
    """8 steps straight == 4 steps, pause + checkpoint, NEW process resumes to 8 (torch backend: bit-exact)."""
    straight = _worker("straight", tmp_path / "a", tmp_path / "straight")
    half = _worker("half", tmp_path / "b", tmp_path / "half")
    assert half["status"] == "paused" and half["step"] == 4 and len(half["losses"]) == 4
    resumed = _worker("resume", tmp_path / "b", tmp_path / "resumed")
    assert straight["status"] == resumed["status"] == "completed"
    assert resumed["losses"] == straight["losses"]  # history carried over + same new losses, exactly
    assert resumed["eval"] == straight["eval"]
    a = torch.load(str(tmp_path / "straight") + ".pt")
    b = torch.load(str(tmp_path / "resumed") + ".pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_each_checkpoint_is_reported_once_after_its_steps_progress(tmp_path: Path) -> None:
    events: list[tuple[str, int]] = []
    cfg = TrainConfig(steps=6, seq_len=32, eval_fraction=0.0, checkpoint_every=2, keep_checkpoints=1)
    t = make_trainer(
        cfg,
        tmp_path,
        on_progress=lambda p: events.append(("progress", p.step)),
        on_checkpoint=lambda c, loss: events.append(("checkpoint", c.step)) or _check(c, loss),
    )
    t.run()
    # Steps 2, 4 and 6 write one each (the final save rewrites step 6's file: told once); each follows its progress.
    ck = [(k, s) for k, s in events if k == "checkpoint"]
    assert ck == [("checkpoint", 2), ("checkpoint", 4), ("checkpoint", 6)]
    for _, s in ck:
        assert events.index(("progress", s)) < events.index(("checkpoint", s))
    # A pause writes and reports its own checkpoint.
    paused: list[int] = []
    t2 = make_trainer(replace(cfg, checkpoint_every=0), tmp_path / "p", should_pause=lambda: bool(t2.step == 3),
                      on_checkpoint=lambda c, _loss: paused.append(c.step))  # fmt: skip
    assert t2.run().status == "paused" and paused == [3]


def _check(c: Any, loss: float) -> None:
    assert c.path.is_file() and c.size_bytes == c.path.stat().st_size and loss > 0


def test_the_checkpoint_a_run_resumes_from_is_reported_with_its_loss(tmp_path: Path) -> None:
    # A kill between writing a checkpoint and reporting it leaves a file nobody was told about; the next run stands on
    # it, so restoring reports it (with the loss of its step), before any step of its own.
    t = make_trainer(replace(CFG, checkpoint_every=0), tmp_path, should_pause=lambda: bool(t.step == 3))
    res = t.run()
    assert res.status == "paused" and res.checkpoint is not None
    path, loss_at_3 = res.checkpoint, t.history.losses[-1]
    t.close()
    told: list[tuple[int, Path, float]] = []
    again = make_trainer(CFG, tmp_path, on_checkpoint=lambda c, loss: told.append((c.step, c.path, loss)))
    again.restore(path)
    assert told == [(3, path, loss_at_3)]
    again.close()
