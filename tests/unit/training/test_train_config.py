"""TrainConfig validation: every bad value is named, all at once."""

import pytest

from lorad.server.engine.training.config import ConfigError, TrainConfig


def test_defaults_are_valid() -> None:
    c = TrainConfig()
    assert c.scaling == 2.0 and c.tokens_per_step == 256


def test_all_errors_reported_together() -> None:
    with pytest.raises(ConfigError) as ei:
        TrainConfig(rank=0, lr=-1.0, schedule="step", warmup_steps=10, steps=5, targets=(), dropout=1.5)
    msgs = ei.value.errors
    joined = "\n".join(msgs)
    for frag in ("rank=0", "lr=-1.0", "schedule='step'", "warmup_steps=10", "targets=()", "dropout=1.5"):
        assert frag in joined
    assert len(msgs) == 6


def test_type_errors_named() -> None:
    with pytest.raises(ConfigError, match=r"steps='10': must be an integer"):
        TrainConfig(steps="10")  # type: ignore[arg-type]


def test_from_dict_unknown_key_and_roundtrip() -> None:
    c = TrainConfig(rank=4, targets=("q_proj", "down_proj"))
    assert TrainConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError) as ei:
        TrainConfig.from_dict({"rnak": 4, "seq_len": 2})
    assert any("unknown key 'rnak'" in m for m in ei.value.errors)
    assert any("seq_len=2" in m for m in ei.value.errors)
