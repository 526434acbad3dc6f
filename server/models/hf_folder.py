"""Reads a Hugging Face checkpoint folder: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path

from lorad.server.models.config import ModelConfig
from safetensors import safe_open
from torch import Tensor


def is_hf_folder(path: Path) -> bool:
    """True when `path` is a directory with config.json and at least one .safetensors file."""
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_config(path: Path) -> ModelConfig:
    """Parses `path/config.json` into a ModelConfig."""
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors shards in name order (adapter files excluded)."""
    return sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("adapter_"))


def read_weights(path: Path) -> dict[str, Tensor]:
    """All tensors of the folder's safetensors shards, HF names, as stored (dtype unchanged).

    Raises:
        FileNotFoundError: The folder has no safetensors file.
    """
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}; save the model with safe_serialization=True")
    out: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                out[k] = sf.get_tensor(k)
    return out
