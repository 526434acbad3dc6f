"""How a TrainConfig field is declared once: help text, bounds, choices, its API name and a daemon job's default."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

KNOB = "knob"  # the dataclass field metadata key holding a field's Knob


@dataclass(frozen=True)
class Knob:
    """One training setting: what it means, which values are valid, and how the daemon's API names and fills it.

    Attributes:
        help: one sentence for ``--help``, docs and error messages.
        lo: lowest valid value (None = unbounded); ``lo_open`` excludes it.
        hi: highest valid value (None = unbounded); ``hi_open`` excludes it.
        choices: the valid values of a string or tuple-of-strings field (empty = any).
        api: the field's path under the API's ``TrainingConfig`` (``lora.rank``); "" = not in the API.
        job_default: what a daemon job gets when its request leaves the field 0 or unset; None = the field's default.
            A callable receives the values decided so far (e.g. alpha's 2 * rank).
        job_default_doc: how the API documents ``job_default`` ("2 * rank"); "" = its value.
    """

    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    api: str = ""
    job_default: Any = None
    job_default_doc: str = ""

    @property
    def bounded(self) -> bool:
        """The field has a numeric range."""
        return self.lo is not None or self.hi is not None

    def span(self) -> str:
        """The valid range in words: ``1 to 128``, ``> 0 and < 1``, ``>= 0``."""
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None and not self.lo_open and not self.hi_open:
            return f"{lo:g} to {hi:g}"
        parts = []
        if lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {lo:g}")
        if hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {hi:g}")
        return " and ".join(parts)

    def admits(self, v: float) -> bool:
        """``v`` is finite and inside the range."""
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def api_default(self, default: Any, decided: Mapping[str, Any]) -> Any:
        """The value a daemon job takes when the request leaves this field 0 or unset."""
        if self.job_default is None:
            return default
        if callable(self.job_default):
            fn: Callable[[Mapping[str, Any]], Any] = self.job_default
            return fn(decided)
        return self.job_default

    def api_default_doc(self, default: Any) -> str:
        """``job_default`` as the API documents it."""
        if self.job_default_doc:
            return self.job_default_doc
        v = default if self.job_default is None else self.job_default
        return f"{v:g}" if isinstance(v, float) else str(v)


def knob(help_text: str, **kw: Any) -> dict[str, Knob]:
    """Field metadata declaring a Knob (``field(default=..., metadata=knob("...", lo=1, api="lora.rank"))``)."""
    return {KNOB: Knob(help_text, **kw)}
