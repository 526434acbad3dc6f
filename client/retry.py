"""Retry policy: exponential backoff with jitter on UNAVAILABLE, for idempotent calls only."""

from __future__ import annotations

import random
from dataclasses import dataclass

#: Unary methods safe to repeat after UNAVAILABLE. Reads are; AppendSamples is (the daemon de-duplicates samples);
#: CreateJob is (request_id makes it idempotent). Pause/Resume/Cancel/Delete/Register are not: a repeat of a call
#: that did reach the daemon would fail with FAILED_PRECONDITION/NOT_FOUND/ALREADY_EXISTS instead of succeeding.
IDEMPOTENT_METHODS = frozenset(
    {
        "ListApps",
        "AppendSamples",
        "ListDatasets",
        "GetDataset",
        "ListSamples",
        "CreateJob",
        "GetJob",
        "ListJobs",
        "ListJobEvents",
        "ListCheckpoints",
        "ListSchedules",
        "ListAdapters",
        "GetAdapter",
        "GetDeviceStatus",
        "GetDiskUsage",
        "CollectGarbage",
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry.

    Attributes:
        max_attempts: Total attempts of one call, including the first (1 disables retries).
        initial_backoff_seconds: Upper bound of the first delay, seconds.
        max_backoff_seconds: Cap of any single delay, seconds.
        multiplier: Growth of the delay bound per attempt.
    """

    max_attempts: int = 5
    initial_backoff_seconds: float = 0.1
    max_backoff_seconds: float = 3.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts}: must be >= 1 (1 disables retries)")
        if self.initial_backoff_seconds < 0 or self.max_backoff_seconds < self.initial_backoff_seconds:
            raise ValueError("backoff seconds must satisfy 0 <= initial_backoff_seconds <= max_backoff_seconds")
        if self.multiplier < 1:
            raise ValueError(f"multiplier={self.multiplier}: must be >= 1")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `retry` (0-based).

        "Equal jitter": half the exponential bound plus a uniform random half, so clients that failed together
        spread out but never retry at once.
        """
        bound = min(self.max_backoff_seconds, self.initial_backoff_seconds * self.multiplier**retry)
        return bound / 2 + (rng or random).uniform(0, bound / 2)


NO_RETRY = RetryPolicy(max_attempts=1)
