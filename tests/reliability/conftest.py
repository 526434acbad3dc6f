"""Reliability suite fixtures and its one-line verdict: `reliability: N passed, M failed; crash points survived ...`.

Tests report counts through the ``tally`` fixture (crash points survived, fuzz cases tried, violations found, and
measured numbers such as latencies). A recorded violation fails the session even if the test itself passed.
The counts are also written to ``.cache/reliability/tally.json`` for CI to archive.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.harness import REPO, tiny_model


class Tally:
    """Counts shared by every reliability test (thread-safe: load tests record from many threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.crash_points = 0
        self.fuzz_cases = 0
        self.violations: list[str] = []
        self.numbers: dict[str, Any] = {}

    def crash_survived(self, n: int = 1) -> None:
        with self._lock:
            self.crash_points += n

    def fuzz(self, n: int = 1) -> None:
        with self._lock:
            self.fuzz_cases += n

    def violation(self, what: str) -> None:
        """Records a broken guarantee (the session fails); the caller should also fail its test."""
        with self._lock:
            self.violations.append(what)

    def number(self, name: str, value: Any) -> None:
        with self._lock:
            self.numbers[name] = value

    def as_dict(self) -> dict[str, Any]:
        return {"crash_points_survived": self.crash_points, "fuzz_cases_tried": self.fuzz_cases,
                "violations": len(self.violations), "violation_list": self.violations[:50],
                "numbers": self.numbers}  # fmt: skip


TALLY = Tally()


@pytest.fixture(scope="session")
def tally() -> Tally:
    """The suite's counters (see Tally)."""
    return TALLY


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama HF folder with a BPE tokenizer and ChatML template (seconds to train on)."""
    return tiny_model(tmp_path_factory.mktemp("models"))


_RESULTS: dict[str, str] = {}  # nodeid -> "passed" | "failed" (reliability tests only)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Counts this folder's tests: a test failed if any phase failed; passed if its call passed."""
    if not report.nodeid.replace("\\", "/").startswith("tests/reliability/"):
        return
    if report.failed:
        _RESULTS[report.nodeid] = "failed"
    elif report.when == "call" and report.passed and _RESULTS.get(report.nodeid) != "failed":
        _RESULTS[report.nodeid] = "passed"


def _counts() -> tuple[int, int]:
    vals = list(_RESULTS.values())
    return vals.count("passed"), vals.count("failed")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run on any recorded violation and writes the tally file."""
    if TALLY.violations and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    out = REPO / ".cache" / "reliability"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "tally.json").write_text(json.dumps(TALLY.as_dict(), indent=2, default=str))
    except OSError:
        pass


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Details: every measured number and every violation (the one-line verdict is printed last, at unconfigure)."""
    if not (TALLY.numbers or TALLY.violations or TALLY.crash_points or TALLY.fuzz_cases):
        return
    tr = terminalreporter
    tr.section("reliability details")
    for k in sorted(TALLY.numbers):
        tr.write_line(f"{k}: {TALLY.numbers[k]}")
    for v in TALLY.violations:
        tr.write_line(f"VIOLATION: {v}", red=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The suite's last output line (after pytest's own stats line), so `make reliability` ends with it."""
    passed, failed = _counts()
    if passed + failed == 0:
        return
    line = (f"reliability: {passed} passed, {failed} failed; crash points survived: {TALLY.crash_points}, "
            f"fuzz cases tried: {TALLY.fuzz_cases}, violations: {len(TALLY.violations)}")  # fmt: skip
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(line)
    else:
        print(line)
