"""Fixtures: tiny random HF checkpoints saved to a session tmp folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_hf import save_tiny_hf


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {a: save_tiny_hf(root, a) for a in ("llama", "llama3", "qwen2", "qwen3")}
