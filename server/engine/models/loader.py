"""Loads a model by source (HF folder, GGUF file, or the bundled SmolLM2 default) through the conversion cache."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from tokenizers import Tokenizer

from lorad.server.engine.models.atomic import atomic_write, held_lock
from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.cache import CheckpointDir, cached, slots, weights_hash, write_checkpoint
from lorad.server.engine.models.config import LoraConfig, ModelConfig
from lorad.server.engine.models.gguf_read import read_gguf
from lorad.server.engine.models.heap import release_free_heap
from lorad.server.engine.models.hf_folder import is_hf_folder, read_config, read_weights
from lorad.server.engine.models.model import CausalLM
from lorad.server.engine.models.sources import source_path
from lorad.server.engine.models.tokenizer import ChatTokenizer

log = structlog.get_logger(__name__)


@dataclass
class LoadedModel:
    """A built model with its tokenizer and identity."""

    model: CausalLM
    tokenizer: ChatTokenizer
    config: ModelConfig
    checkpoint: CheckpointDir

    @property
    def model_hash(self) -> str:
        """Content hash of the base weights."""
        return self.checkpoint.model_hash

    @property
    def tokenizer_hash(self) -> str:
        """Content hash of the tokenizer + chat template."""
        return self.checkpoint.tokenizer_hash


def resolve(source: str | Path | None, cache_root: Path) -> CheckpointDir:
    """Returns a loadable HF-style folder for `source`, converting a GGUF into `cache_root` on first use.

    Args:
        source: HF folder, .gguf file, or None for the bundled default.
        cache_root: Directory for converted models and hash records.

    Raises:
        FileNotFoundError: The source does not exist or is neither an HF folder nor a GGUF file.
    """
    path = source_path(source)
    at = slots(path, cache_root)
    # One conversion (or hashing) per source at a time, across threads and processes: a status read and a job
    # starting together would otherwise both spend the conversion's time and memory, and the later commit would
    # swap the folder out from under the earlier one's reader. Whoever waited finds the entry complete.
    with held_lock(at.lock):
        ready = cached(path, at)
        if ready is not None:
            return ready
        if path.is_file() and path.suffix == ".gguf":
            return _converted(path, at.folder)
        if is_hf_folder(path):
            return _hashed(path, at.hashes)
    raise FileNotFoundError(f"{path} is neither a .gguf file nor an HF folder with config.json + *.safetensors")


def _converted(path: Path, out: Path) -> CheckpointDir:
    """The GGUF `path` converted into an HF folder at `out`."""
    t0 = time.perf_counter()
    g = read_gguf(path)
    parse_s = time.perf_counter() - t0
    tok = ChatTokenizer(Tokenizer.from_str(g.tokenizer_json), g.tokenizer_config)
    ck = write_checkpoint(
        out,
        g.config,
        g.weights,
        g.tokenizer_json,
        g.tokenizer_config,
        source=str(path),
        tokenizer_hash=tok.content_hash(),
    )
    log.info("gguf_converted", parse_seconds=round(parse_s, 2), total_seconds=round(time.perf_counter() - t0, 2))
    # The conversion went through full-size float copies of every weight; freed now, but the heap would keep them
    # (tcmalloc ~700 MB, glibc ~200 MB for SmolLM2) in a daemon that only wanted the model's facts.
    del g, tok
    release_free_heap()
    return ck


def _hashed(path: Path, rec: Path) -> CheckpointDir:
    """The plain HF folder `path` hashed, its hashes recorded at `rec` (found there by (path, sizes, mtimes) later)."""
    h = {
        "model_hash": weights_hash(read_weights(path)),
        "tokenizer_hash": ChatTokenizer.from_dir(path).content_hash(),
    }
    atomic_write(rec, lambda f: f.write(json.dumps(h).encode()))
    return CheckpointDir(path, h["model_hash"], h["tokenizer_hash"], str(path))


def load_model(
    source: str | Path | None = None,
    *,
    cache_root: Path,
    backend: str = "torch",
    precision: Any = "fp32",
    lora: LoraConfig | None = None,
) -> LoadedModel:
    """Resolves `source` (converting once), then builds the model on `backend` with LoRA adapters.

    Args:
        source: HF folder, .gguf file, or None for the bundled SmolLM2-135M-Instruct.
        cache_root: Conversion cache directory (also passed to the backend for its own caches).
        backend: lorad.kernels backend.
        precision: A precision name or a PrecisionPlan.
        lora: Adapter shape; None builds a base-only model.

    Returns:
        The LoadedModel.
    """
    t0 = time.perf_counter()
    ck = resolve(source, cache_root)
    t1 = time.perf_counter()
    cfg = read_config(ck.path)
    model = build_model(
        cfg,
        read_weights(ck.path),
        backend=backend,
        precision=precision,
        lora=lora,
        cache_dir=cache_root / "backend",
        model_hash=ck.model_hash,
    )
    tok = ChatTokenizer.from_dir(ck.path)
    release_free_heap()  # the full-precision copies the build went through
    log.info(
        "model_loaded",
        model_hash=ck.model_hash[:16],
        resolve_seconds=round(t1 - t0, 3),
        build_seconds=round(time.perf_counter() - t1, 3),
        backend=backend,
    )
    return LoadedModel(model, tok, cfg, ck)
