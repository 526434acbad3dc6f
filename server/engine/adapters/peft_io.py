"""Adapters in PEFT format (adapter_config.json + adapter_model.safetensors) with lorad provenance metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from lorad.server.engine.adapters.metadata import METADATA_FILE, AdapterMetadata
from lorad.server.engine.models.atomic import building_dir
from lorad.server.engine.models.config import LORA_TARGETS, LoraConfig
from lorad.server.engine.models.model import AdapterWeights, CausalLM

log = structlog.get_logger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


class AdapterBaseMismatchError(ValueError):
    """The adapter was trained on a different base model or tokenizer than the one it is applied to."""


@dataclass
class Adapter:
    """A LoRA adapter: shape, PEFT-named tensors and (for lorad-written adapters) provenance."""

    lora: LoraConfig
    tensors: dict[str, Tensor]
    metadata: AdapterMetadata | None

    @classmethod
    def from_model(cls, model: CausalLM, metadata: AdapterMetadata) -> Adapter:
        """Snapshots a model's LoRA parameters.

        Raises:
            ValueError: The model has no LoRA adapters.
        """
        if model.lora_config is None:
            raise ValueError("model was built without LoRA (lora=None); nothing to save")
        return cls(model.lora_config, model.lora_state_dict(), metadata)

    def weights(self) -> AdapterWeights:
        """The adapter as inference weights (HF module name -> (A, B)) for `CausalLM.logits(adapter=...)`."""
        out: dict[str, tuple[Tensor, Tensor]] = {}
        for k, a in self.tensors.items():
            if k.endswith(".lora_A.weight"):
                mod = k[len(_PREFIX) : -len(".lora_A.weight")]
                out[mod] = (a.float(), self.tensors[f"{_PREFIX}{mod}.lora_B.weight"].float())
        return AdapterWeights(out, self.lora.scale)

    def check_base(self, model_hash: str, tokenizer_hash: str) -> None:
        """Refuses a base whose weights or tokenizer differ from the training base.

        Raises:
            AdapterBaseMismatchError: Hashes differ (both are named in the message).
        """
        m = self.metadata
        if m is None:
            log.warning("adapter_base_unverified", reason="no lorad metadata (foreign PEFT adapter)")
            return
        if m.base_model_hash != model_hash:
            raise AdapterBaseMismatchError(
                f"adapter was trained on base model {m.base_model_hash[:16]}… but the loaded base is "
                f"{model_hash[:16]}…; load the base it was trained on ({m.base_model_source or 'unknown source'})"
            )
        if m.tokenizer_hash != tokenizer_hash:
            raise AdapterBaseMismatchError(
                f"adapter was trained with tokenizer {m.tokenizer_hash[:16]}… but the loaded tokenizer is "
                f"{tokenizer_hash[:16]}…; use the training base's tokenizer"
            )


def peft_config(lora: LoraConfig, base_name_or_path: str = "") -> dict[str, Any]:
    """adapter_config.json contents PEFT reads back as a LoraConfig."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_adapter(path: Path, adapter: Adapter, base_name_or_path: str = "") -> Path:
    """Writes the adapter folder atomically (built in a temp dir, fsynced, renamed over `path`).

    Args:
        path: Target folder (replaced if it exists).
        adapter: The adapter.
        base_name_or_path: Written as base_model_name_or_path (PEFT uses it when no base is passed).

    Returns:
        `path`.
    """
    st_meta = {"format": "pt"}
    with building_dir(path) as tmp:
        if adapter.metadata is not None:
            meta = adapter.metadata.to_json()
            (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2))
            st_meta |= {
                "lorad_base_model_hash": adapter.metadata.base_model_hash,
                "lorad_tokenizer_hash": adapter.metadata.tokenizer_hash,
            }
        save_file(
            {k: v.detach().float().contiguous() for k, v in adapter.tensors.items()},
            str(tmp / WEIGHTS_FILE),
            metadata=st_meta,
        )
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_config(adapter.lora, base_name_or_path), indent=2))
    log.info("adapter_saved", tensors=len(adapter.tensors), rank=adapter.lora.rank)
    return path


def _lora_from_peft(cfg: dict[str, Any], path: Path) -> LoraConfig:
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        problems.append("use_rslora/use_dora are not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        problems.append("per-module rank_pattern/alpha_pattern are not supported")
    tm = cfg.get("target_modules") or []
    if isinstance(tm, str):
        problems.append(f"target_modules as a regex ({tm!r}) is not supported; list module names")
        tm = []
    unknown = [t for t in tm if t not in LORA_TARGETS]
    if unknown:
        problems.append(f"target_modules {unknown} are not Llama/Qwen projections")
    if problems:
        raise ValueError(f"{path / CONFIG_FILE}: " + "; ".join(problems))
    return LoraConfig(
        rank=int(cfg["r"]),
        alpha=float(cfg["lora_alpha"]),
        dropout=float(cfg.get("lora_dropout", 0.0)),
        targets=tuple(t for t in LORA_TARGETS if t in tm),
    )


def load_adapter(path: Path) -> Adapter:
    """Reads a PEFT adapter folder (lorad metadata optional).

    Raises:
        FileNotFoundError: adapter_config.json or adapter_model.safetensors is missing.
        ValueError: The config uses PEFT features lorad does not implement.
    """
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path / f} missing; not a PEFT adapter folder")
    lora = _lora_from_peft(json.loads((path / CONFIG_FILE).read_text()), path)
    tensors: dict[str, Tensor] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as sf:
        for k in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            # PEFT may write the adapter name into keys (`lora_A.default.weight`); normalise it away.
            tensors[k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = sf.get_tensor(
                k
            ).float()
    meta_path = path / METADATA_FILE
    meta = AdapterMetadata.from_json(json.loads(meta_path.read_text())) if meta_path.is_file() else None
    return Adapter(lora, tensors, meta)


def apply_adapter(model: CausalLM, adapter: Adapter, *, model_hash: str, tokenizer_hash: str) -> None:
    """Loads the adapter into the model's own LoRA parameters after checking the base.

    Raises:
        AdapterBaseMismatchError: Different base model/tokenizer.
        KeyError: The model's LoRA shape (rank/targets) differs from the adapter's.
    """
    adapter.check_base(model_hash, tokenizer_hash)
    model.load_lora_state_dict(adapter.tensors)
