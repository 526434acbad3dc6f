"""Exact training checkpoints: atomic single-file writes, a listing by step, and validated loading.

torch is imported by the functions that read or write tensors: the daemon lists checkpoints at start (to say where a
recovered job resumes) without importing it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from lorad.server.engine.models.atomic import atomic_write as _atomic_write
from lorad.server.engine.models.config import hf_targets

log = structlog.get_logger(__name__)

FORMAT = "lorad-train-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d{8})\.pt$")
_TMP_PREFIX = ".tmp-"
REQUIRED = (
    "format",
    "version",
    "step",
    "config",
    "data_fingerprint",
    "cursor",
    "adapter",
    "optimizer",
    "rng",
    "history",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, incomplete, or made for another job."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint on disk."""

    step: int
    path: Path
    size_bytes: int


def checkpoint_path(directory: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives (zero-padded so names sort by step)."""
    return directory / f"step-{step:08d}.pt"


def atomic_write(path: Path, write: Callable[[Any], object]) -> None:
    """Crash-safe write (``lorad.server.engine.models.atomic.atomic_write``) with the temp prefix stale-temp cleanup
    recognises.

    Args:
        path: final file path.
        write: callback that writes the content to the open binary file.
    """
    _atomic_write(path, write, tmp_prefix=_TMP_PREFIX)


def capture_rng() -> dict[str, Any]:
    """The global RNG states that training consumes: torch CPU, python `random`, numpy (as plain lists)."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [
            str(kind),
            torch.from_numpy(np.asarray(keys).astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(gauss),
        ],
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Restores the states saved by `capture_rng`."""
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def save(directory: Path, state: dict[str, Any], *, keep: int) -> Path:
    """Atomically writes a checkpoint for `state["step"]` and prunes all but the newest `keep`.

    Returns:
        The checkpoint path.
    """
    import torch

    state = {"format": FORMAT, "version": VERSION, **state}
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint state lacks {missing}")
    path = checkpoint_path(directory, int(state["step"]))
    atomic_write(path, lambda f: torch.save(state, f))
    for old in list_checkpoints(directory)[:-keep]:
        old.path.unlink(missing_ok=True)
    log.info("checkpoint_saved", step=state["step"], bytes=path.stat().st_size)
    return path


def list_checkpoints(directory: Path) -> list[CheckpointInfo]:
    """Complete checkpoints in `directory`, oldest first; temp files of interrupted writes are not listed."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append(CheckpointInfo(int(m.group(1)), p, p.stat().st_size))
    return sorted(found, key=lambda c: c.step)


def checkpoint_dir(work_dir: Path) -> Path:
    """Where a job's checkpoints live inside its work folder (the recipe writes there, a restarted daemon looks)."""
    return work_dir / "checkpoints"


def latest(directory: Path) -> CheckpointInfo | None:
    """The newest complete checkpoint, if any."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def remove_stale_temps(directory: Path) -> int:
    """Deletes temp files left by a writer that was killed mid-write; returns how many."""
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.iterdir() if p.name.startswith(_TMP_PREFIX)]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def load(path: Path, *, expect: dict[str, Any] | None = None) -> dict[str, Any]:
    """Loads and validates a checkpoint.

    Args:
        path: checkpoint file.
        expect: values the checkpoint must match, by key: "config" (a dict compared field by field over the keys
            given), "data_fingerprint", "adapter_shapes" ({name: shape}).

    Returns:
        The checkpoint dict.

    Raises:
        CheckpointError: unreadable, wrong format, missing keys, step/name mismatch, or a mismatch with `expect`
            (all mismatches are listed).
    """
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a lorad training checkpoint")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {state.get('version')}, this build reads {VERSION}")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}")
    m = _NAME.match(path.name)
    if m and int(m.group(1)) != state["step"]:
        raise CheckpointError(f"{path} holds step {state['step']}, its name says {int(m.group(1))}")
    problems: list[str] = []
    expect = expect or {}
    if isinstance(state["config"].get("targets"), list):  # checkpoints written before HF names hold q, k, …
        state["config"]["targets"] = list(hf_targets(state["config"]["targets"]))
    for k, v in expect.get("config", {}).items():
        got = state["config"].get(k)
        if got != v:
            problems.append(f"config {k}: checkpoint has {got!r}, job has {v!r}")
    fp = expect.get("data_fingerprint")
    if fp is not None and state["data_fingerprint"] != fp:
        problems.append("data_fingerprint differs: the job's training samples changed since the checkpoint")
    shapes = expect.get("adapter_shapes")
    if shapes is not None:
        got_shapes = {k: tuple(t.shape) for k, t in state["adapter"].items()}
        want = {k: tuple(s) for k, s in shapes.items()}
        if got_shapes != want:
            diff = sorted(set(got_shapes.items()) ^ set(want.items()))[:4]
            problems.append(f"adapter tensors differ from the model's (first differences: {diff})")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this job:\n  - " + "\n  - ".join(problems))
    return state
