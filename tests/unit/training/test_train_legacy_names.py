"""Files older lorad wrote with short target names (q, k, …, down) still load: checkpoints, metadata, TOML.

Cached plans: tests/unit/training/test_train_plan.py."""

from pathlib import Path

import torch

from lorad.server.engine.adapters import AdapterMetadata
from lorad.server.engine.models.config import LEGACY_TARGETS, LORA_TARGETS
from lorad.server.engine.training.config import TrainConfig
from tests.unit.training.test_train_recipe import _run as run_torch

SHORT = tuple(LEGACY_TARGETS)


def test_short_names_map_to_hf_names_everywhere_they_are_read() -> None:
    assert tuple(LEGACY_TARGETS.values()) == LORA_TARGETS
    assert TrainConfig.from_dict({"targets": ["q", "down"]}).targets == ("q_proj", "down_proj")
    meta = AdapterMetadata(base_model_hash="h", tokenizer_hash="t", rank=2, alpha=4.0, targets=("v_proj",)).to_json()
    meta["targets"] = ["v"]  # as lorad_metadata.json was written before
    assert AdapterMetadata.from_json(meta).targets == ("v_proj",)


def test_a_checkpoint_with_short_target_names_resumes(tmp_path: Path) -> None:
    ref = run_torch(tmp_path / "straight")
    n: list[int] = []
    p = run_torch(tmp_path / "job", on_progress=lambda pr: n.append(pr.step), should_pause=lambda: len(n) >= 2)
    assert p.status == "paused"
    (ck,) = (tmp_path / "job" / "checkpoints").glob("step-*.pt")
    state = torch.load(ck, weights_only=True)
    assert state["config"]["targets"] == list(LORA_TARGETS)
    state["config"]["targets"] = list(SHORT)
    torch.save(state, ck)
    r = run_torch(tmp_path / "job")
    assert r.status == "completed" and r.resumed_from == 2 and r.losses == ref.losses


def test_the_sdk_federated_table_names_the_engine_targets() -> None:
    from lorad.client.federated.lora import TARGETS
    from lorad.server.engine.models.config import TARGET_TO_HF

    assert {t: block for t, (block, _) in TARGET_TO_HF.items()} == TARGETS
