"""Model cache: a GGUF (or HF folder) converted once into safetensors + tokenizer + config + content hashes."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from lorad.server.engine.models.atomic import building_dir
from lorad.server.engine.models.config import ModelConfig
from lorad.server.engine.models.hf_folder import is_hf_folder
from lorad.server.engine.models.sources import source_path

if TYPE_CHECKING:
    from torch import Tensor

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
    import torch

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


@dataclass(frozen=True)
class Slots:
    """Where the cache keeps what it knows about one source, by its ``source_key``."""

    folder: Path  # a GGUF's converted HF folder
    hashes: Path  # a plain HF folder's recorded hashes
    lock: Path  # held while the source is converted or hashed


def slots(path: Path, cache_root: Path) -> Slots:
    """The cache paths of the source file or folder at `path`."""
    key = source_key(path)
    return Slots(
        cache_root / "models" / key, cache_root / "hashes" / f"{key}.json", cache_root / "locks" / f"{key}.lock"
    )


def cached(path: Path, at: Slots) -> CheckpointDir | None:
    """The source at `path` as a ready folder with its hashes, if they are known: a GGUF's complete conversion, an HF
    folder's own manifest or recorded hashes; None while it still has to be converted or hashed. Reads two small files
    at most (no weights, no torch)."""
    if path.is_file() and path.suffix == ".gguf":
        m = read_manifest(at.folder)
        return None if m is None else CheckpointDir(at.folder, m["model_hash"], m["tokenizer_hash"], m["source"])
    if not is_hf_folder(path):
        return None
    m = read_manifest(path)
    if m is not None:
        return CheckpointDir(path, m["model_hash"], m["tokenizer_hash"], m["source"])
    if not at.hashes.is_file():
        return None
    h = json.loads(at.hashes.read_text())
    return CheckpointDir(path, h["model_hash"], h["tokenizer_hash"], str(path))


def cached_checkpoint(source: str | Path | None, cache_root: Path) -> CheckpointDir | None:
    """``cached`` for a model source (None = the bundled GGUF): what ``resolve`` returns without converting or
    hashing, or None if it would have to.

    Raises:
        FileNotFoundError: the source does not exist.
    """
    path = source_path(source)
    return cached(path, slots(path, cache_root))


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
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    mhash = weights_hash(weights)
    with building_dir(out) as tmp:
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
    log.info("model_cache_written", model_hash=mhash[:16], seconds=round(time.perf_counter() - t0, 2))
    return CheckpointDir(out, mhash, tokenizer_hash, source)
