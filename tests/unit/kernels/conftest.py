"""Shared fixtures for the kernel tests: HTP availability and marker registration."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Declared in pyproject too; registering here keeps `--strict-markers` happy when run alone.
    config.addinivalue_line("markers", "htp: uses the QNN HTP simulator (slow)")


@pytest.fixture(scope="session")
def htp_available() -> None:
    """Skip (with the load error as reason) when the QNN HTP EP cannot load on this host."""
    from lorad.kernels.qnn_htp import htp_unavailable_reason

    reason = htp_unavailable_reason()
    if reason:
        pytest.skip(f"QNN HTP EP unavailable: {reason}")
