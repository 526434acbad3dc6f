"""What lorad records with every adapter: base identity, LoRA shape, precision plan, data window, metrics."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from lorad.server.engine.models.config import hf_targets

METADATA_FILE = "lorad_metadata.json"
METADATA_VERSION = 1


@dataclass(frozen=True)
class AdapterMetadata:
    """Provenance of one adapter (stored as lorad_metadata.json and mirrored into safetensors metadata)."""

    base_model_hash: str = field(metadata={"help": "content hash of the base weights (sha256 hex)"})
    tokenizer_hash: str = field(metadata={"help": "content hash of the tokenizer + chat template"})
    rank: int
    alpha: float
    targets: tuple[str, ...] = field(metadata={"help": "HF module names among q_proj … down_proj"})
    arch: str = "llama"
    precision_plan: dict[str, Any] | str = field(default="fp32", metadata={"help": "plan JSON or one precision"})
    backend: str = "torch"
    data_window: dict[str, Any] = field(default_factory=dict, metadata={"help": "e.g. {from, to, samples, tokens}"})
    steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict, metadata={"help": "e.g. {train_loss, eval_loss}"})
    created_at: float = field(default_factory=time.time, metadata={"help": "unix seconds"})
    base_model_source: str = field(default="", metadata={"help": "hub id or folder name of the base, never a path"})
    version: int = METADATA_VERSION

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AdapterMetadata:
        """Parses `to_json` output (unknown keys from newer versions are ignored).

        Raises:
            ValueError: Required fields are missing (all of them are named).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [n for n in required if n not in d]
        if missing:
            raise ValueError(f"adapter metadata lacks {missing}; was it written by lorad?")
        kw = {k: v for k, v in d.items() if k in names}
        kw["targets"] = hf_targets(kw["targets"])  # files written before HF names carry q, k, …, down
        return cls(**kw)
