"""Nightly training windows on APScheduler 3.x with a persistent SQLite job store."""

from lorad.server.scheduler.windows import WindowScheduler

__all__ = ["WindowScheduler"]
