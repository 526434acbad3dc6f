"""Fixtures for the SDK tests: the daemon test double on a temp Unix socket and fast retry policies."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.fake_daemon import FakeDaemon


@pytest.fixture
def fake() -> Iterator[FakeDaemon]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="lorad-sdk-", dir="/tmp"))
    daemon = FakeDaemon(d / "lorad.sock").start()
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No developer config or token leaks into the tests."""
    for var in (
        "LORAD_TOKEN",
        "LORAD_TARGET",
        "LORAD_OWNER_TOKEN",
        "LORAD_CONFIG",
        "LORAD_STORAGE_DATA_DIR",
        "LORAD_SERVER_SOCKET_PATH",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LORAD_CLIENT_CONFIG", str(tmp_path / "client.toml"))
