"""Fixtures: a tiny HF base per architecture with a random nonzero lorad adapter."""

from __future__ import annotations

import pytest

from tests.fixtures.tiny_adapter import Trained, make_trained


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return make_trained(tmp_path_factory.mktemp(request.param), request.param)
