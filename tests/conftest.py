"""Fixtures shared by every test folder; the builders behind them live in tests/fixtures/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorad.kernels import fused
from tests.fixtures.tiny_hf import save_tiny_hf

# Daemons and CLIs the tests start with a temporary HOME would each compile the fused kernels into it; this run's
# cache (the one make setup filled) is handed down to them instead.
os.environ.setdefault(fused.ENV_CACHE, str(fused.cache_dir()))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (vocab 320, hidden 64) with a BPE tokenizer and a ChatML template."""
    return save_tiny_hf(tmp_path_factory.mktemp("models"), "llama")
