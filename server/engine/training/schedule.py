"""Learning-rate schedules: linear warm-up, then cosine, linear or constant, as a pure function of the step."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float = 0.0) -> float:
    """The learning rate used for optimizer step `step` (0-based).

    Matches Hugging Face's `get_{cosine,linear}_schedule_with_warmup` when `min_lr_ratio` is 0: warm-up ramps
    `lr * step / warmup_steps`, then the decay runs from `lr` at `warmup_steps` towards `lr * min_lr_ratio` at `steps`.
    Being a pure function of the step, the schedule's checkpoint state is just the step number.

    Args:
        step: 0-based optimizer step.
        lr: peak learning rate.
        steps: total optimizer steps.
        warmup_steps: linear warm-up steps.
        schedule: "cosine", "linear" or "constant".
        min_lr_ratio: final LR as a fraction of `lr`.

    Returns:
        The learning rate for that step.

    Raises:
        ValueError: unknown schedule or negative step.
    """
    if step < 0:
        raise ValueError(f"step={step}: must be >= 0")
    if step < warmup_steps:
        return lr * step / max(1, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    if schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear":
        factor = 1.0 - progress
    elif schedule == "constant":
        return lr
    else:
        raise ValueError(f"schedule={schedule!r}: must be one of ('cosine', 'linear', 'constant')")
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * factor)
