"""Model cache: a GGUF (or HF folder) converted once into safetensors + tokenizer + config + content hashes."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from safetensors.torch import save_file
from torch import Tensor

from lorad.server.engine.models.atomic import commit_dir, make_temp_dir
from lorad.server.engine.models.config import ModelConfig

log = structlog.get_logger(__name__)

MANIFEST = "lorad_model.json"
CACHE_FORMAT = 1  # bump when the cache layout changes; old entries are then rebuilt


@dataclass(frozen=True)
class CheckpointDir:
    """A ready-to-load HF-style folder with its identity."""

    path: Path
    model_hash: str
    tokenizer_hash: str
    source: str


def weights_hash(weights: Mapping[str, Tensor]) -> str:
    """sha256 over tensor names, dtypes, shapes and bytes in name order (independent of file layout)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def source_key(path: Path) -> str:
    """Cache key of a source file/folder: absolute path, size and mtime (no full read on every load)."""
    path = path.resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    st = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    return hashlib.sha256(f"{CACHE_FORMAT}|{path}|{st}".encode()).hexdigest()[:20]


def read_manifest(path: Path) -> dict[str, str] | None:
    """The cache manifest of a converted folder, or None when absent/stale."""
    m = path / MANIFEST
    if not m.is_file():
        return None
    data = json.loads(m.read_text())
    return data if data.get("format") == CACHE_FORMAT else None


def write_checkpoint(
    out: Path,
    cfg: ModelConfig,
    weights: dict[str, Tensor],
    tokenizer_json: str,
    tokenizer_config: dict[str, object],
    *,
    source: str,
    tokenizer_hash: str,
) -> CheckpointDir:
    """Writes an HF-style folder (model.safetensors, config.json, tokenizer files) and its manifest.

    The folder is built under a temporary name and renamed into place, so a crash never leaves a half cache.

    Returns:
        The written checkpoint.
    """
    t0 = time.perf_counter()
    tmp = make_temp_dir(out)
    mhash = weights_hash(weights)
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(tmp / "model.safetensors"),
        metadata={
            "format": "pt",
            "lorad_model_hash": mhash,
        },
    )
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    (tmp / "tokenizer.json").write_text(tokenizer_json)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    manifest = {"format": CACHE_FORMAT, "model_hash": mhash, "tokenizer_hash": tokenizer_hash, "source": source}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))  # written last: its presence marks a complete entry
    commit_dir(tmp, out)
    log.info("model_cache_written", model_hash=mhash[:16], seconds=round(time.perf_counter() - t0, 2))
    return CheckpointDir(out, mhash, tokenizer_hash, source)
