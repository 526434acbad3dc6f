"""Fixtures shared by every test folder; the builders behind them live in tests/fixtures/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_hf import save_tiny_hf


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (vocab 320, hidden 64) with a BPE tokenizer and a ChatML template."""
    return save_tiny_hf(tmp_path_factory.mktemp("models"), "llama")
