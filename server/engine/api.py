"""The engine's one public surface: everything the daemon, the inference host and bench/ use of the engine, typed.

Verbs (each re-exports the engine function that does it; nothing here changes what they do):

- load: ``resolve(source, cache_root)`` (a GGUF converted once into the cache, an HF folder hashed once) and
  ``load_model(source, cache_root=, backend=, precision=, lora=) -> LoadedModel`` (model, tokenizer, hashes);
  ``read_config`` / ``read_weights`` read a resolved folder without building a model; ``cached_checkpoint`` is
  ``resolve`` for a source already converted or hashed (None otherwise), and like the two readers needs no torch.
- plan: ``resolve_backend``, ``resolve_precision``, ``plans_here``, ``known_plan``, ``plan_job`` -> ``JobPlan``.
- train: ``run_recipe(cfg, samples, ..., on_progress=, on_phase=, on_loaded=, should_pause=) -> RecipeResult``
  (eval losses before/after, steps, the saved adapter and its metadata); ``prepare`` turns samples into batches
  (``DataError`` carries the report of what was rejected); ``Trainer`` for a measurement outside the recipe.
- export: ``save_adapter`` (PEFT), ``export_gguf_lora`` (llama.cpp LoRA), ``export_merged`` (base + adapter).
- generate: ``generate(model, tokenizer, ids, SamplingConfig, adapter=) -> Iterator[Token]``.

- helpers: ``TrainConfig`` and its field declarations (``api_knobs``, ``Knob``, ``job_config``), ``atomic_write``,
  the sample types, checkpoint listing, ``prepare_main`` (`lorad prepare`), the bundle loader for qnn-htp and
  ``malloc_in_use`` (which malloc serves this process).

Importing this module imports no engine module: each name is imported on its first use (PEP 562 ``__getattr__``),
so a name costs what importing it from its own module cost (``lorad prepare --list-socs`` and ``import lorad.client``
stay torch-free). The ``TYPE_CHECKING`` block and ``_LAZY`` name the same objects (a test checks).
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorad.server.engine.adapters.gguf_lora import export_gguf_lora
    from lorad.server.engine.adapters.merge import export_merged
    from lorad.server.engine.adapters.metadata import METADATA_FILE, AdapterMetadata
    from lorad.server.engine.adapters.peft_io import (
        Adapter,
        AdapterBaseMismatchError,
        apply_adapter,
        load_adapter,
        save_adapter,
    )
    from lorad.server.engine.models.atomic import atomic_write
    from lorad.server.engine.models.build import build_model
    from lorad.server.engine.models.cache import cached_checkpoint
    from lorad.server.engine.models.config import LoraConfig, ModelConfig
    from lorad.server.engine.models.generate import SamplingConfig, Token, generate
    from lorad.server.engine.models.heap import malloc_in_use
    from lorad.server.engine.models.hf_folder import read_config, read_weights
    from lorad.server.engine.models.kv_cache import KVCache
    from lorad.server.engine.models.loader import LoadedModel, load_model, resolve
    from lorad.server.engine.models.model import AdapterWeights, CausalLM, Linear
    from lorad.server.engine.models.sources import default_model_path, portable_base_name
    from lorad.server.engine.models.tokenizer import ChatTokenizer
    from lorad.server.engine.prepare.cli import prepare_main
    from lorad.server.engine.prepare.load import Bundle, load_bundle, open_frozen_linears
    from lorad.server.engine.prepare.manifest import BundleError, model_hash_of_folder
    from lorad.server.engine.training.checkpoint import (
        CheckpointError,
        CheckpointInfo,
        capture_rng,
        checkpoint_dir,
        list_checkpoints,
        restore_rng,
    )
    from lorad.server.engine.training.checkpoint import latest as latest_checkpoint
    from lorad.server.engine.training.config import ConfigError, TrainConfig, api_key, api_knobs, job_config
    from lorad.server.engine.training.data import (
        ChatSample,
        DataError,
        DataReport,
        Message,
        PreparedData,
        Sample,
        TextSample,
        prepare,
    )
    from lorad.server.engine.training.heartbeat import PERIOD_S as HEARTBEAT_PERIOD_S
    from lorad.server.engine.training.heartbeat import Heartbeat
    from lorad.server.engine.training.knobs import Knob
    from lorad.server.engine.training.packing import BatchStream, eval_batches, trim_tail
    from lorad.server.engine.training.precision import JobPlan, known_plan, plan_job, plans_here
    from lorad.server.engine.training.recipe import (
        RecipeResult,
        resolve_backend,
        resolve_precision,
        run_recipe,
        seed_everything,
    )
    from lorad.server.engine.training.schedule import lr_at
    from lorad.server.engine.training.trainer import Progress, Trainer

_E = "lorad.server.engine."
# facade name -> (engine module, name there); imported on first use.
_LAZY: dict[str, tuple[str, str]] = {
    **{n: (_E + "adapters.peft_io", n) for n in ("Adapter", "AdapterBaseMismatchError", "apply_adapter",
                                                 "load_adapter", "save_adapter")},
    **{n: (_E + "adapters.metadata", n) for n in ("METADATA_FILE", "AdapterMetadata")},
    "export_gguf_lora": (_E + "adapters.gguf_lora", "export_gguf_lora"),
    "export_merged": (_E + "adapters.merge", "export_merged"),
    "atomic_write": (_E + "models.atomic", "atomic_write"),
    "build_model": (_E + "models.build", "build_model"),
    "cached_checkpoint": (_E + "models.cache", "cached_checkpoint"),
    **{n: (_E + "models.config", n) for n in ("LoraConfig", "ModelConfig")},
    **{n: (_E + "models.generate", n) for n in ("SamplingConfig", "Token", "generate")},
    "malloc_in_use": (_E + "models.heap", "malloc_in_use"),
    **{n: (_E + "models.hf_folder", n) for n in ("read_config", "read_weights")},
    "KVCache": (_E + "models.kv_cache", "KVCache"),
    **{n: (_E + "models.loader", n) for n in ("LoadedModel", "load_model", "resolve")},
    **{n: (_E + "models.model", n) for n in ("AdapterWeights", "CausalLM", "Linear")},
    **{n: (_E + "models.sources", n) for n in ("default_model_path", "portable_base_name")},
    "ChatTokenizer": (_E + "models.tokenizer", "ChatTokenizer"),
    "prepare_main": (_E + "prepare.cli", "prepare_main"),
    **{n: (_E + "prepare.load", n) for n in ("Bundle", "load_bundle", "open_frozen_linears")},
    **{n: (_E + "prepare.manifest", n) for n in ("BundleError", "model_hash_of_folder")},
    **{n: (_E + "training.checkpoint", n) for n in ("CheckpointError", "CheckpointInfo", "capture_rng",
                                                    "checkpoint_dir", "list_checkpoints", "restore_rng")},
    "latest_checkpoint": (_E + "training.checkpoint", "latest"),
    **{n: (_E + "training.config", n) for n in ("ConfigError", "TrainConfig", "api_key", "api_knobs", "job_config")},
    **{n: (_E + "training.data", n) for n in ("ChatSample", "DataError", "DataReport", "Message", "PreparedData",
                                              "Sample", "TextSample", "prepare")},
    "Heartbeat": (_E + "training.heartbeat", "Heartbeat"),
    "HEARTBEAT_PERIOD_S": (_E + "training.heartbeat", "PERIOD_S"),
    "Knob": (_E + "training.knobs", "Knob"),
    **{n: (_E + "training.packing", n) for n in ("BatchStream", "eval_batches", "trim_tail")},
    **{n: (_E + "training.precision", n) for n in ("JobPlan", "known_plan", "plan_job", "plans_here")},
    **{n: (_E + "training.recipe", n) for n in ("RecipeResult", "resolve_backend", "resolve_precision", "run_recipe",
                                                "seed_everything")},
    "lr_at": (_E + "training.schedule", "lr_at"),
    **{n: (_E + "training.trainer", n) for n in ("Progress", "Trainer")},
}  # fmt: skip
# Two threads importing the engine at once (a job starting while a Generate loads its base) would meet a partially
# initialised module; every first-use import here holds this, and the daemon imports the engine only through here.
_IMPORTS = threading.RLock()


def __getattr__(name: str) -> object:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _IMPORTS:  # not cached here: a name always reads its module's current value, as a direct import did
        return getattr(importlib.import_module(where[0]), where[1])


def warm_up() -> None:
    """Imports the training and generation modules now (torch, kernels: seconds), so a job's or a Generate's first
    step does not pay for it."""
    with _IMPORTS:
        importlib.import_module(_E + "models.generate")
        importlib.import_module(_E + "training.recipe")


__all__ = [
    "HEARTBEAT_PERIOD_S",
    "METADATA_FILE",
    "Adapter",
    "AdapterBaseMismatchError",
    "AdapterMetadata",
    "AdapterWeights",
    "BatchStream",
    "Bundle",
    "BundleError",
    "CausalLM",
    "ChatSample",
    "ChatTokenizer",
    "CheckpointError",
    "CheckpointInfo",
    "ConfigError",
    "DataError",
    "DataReport",
    "Heartbeat",
    "JobPlan",
    "KVCache",
    "Knob",
    "Linear",
    "LoadedModel",
    "LoraConfig",
    "Message",
    "ModelConfig",
    "PreparedData",
    "Progress",
    "RecipeResult",
    "Sample",
    "SamplingConfig",
    "TextSample",
    "Token",
    "TrainConfig",
    "Trainer",
    "api_key",
    "api_knobs",
    "apply_adapter",
    "atomic_write",
    "build_model",
    "cached_checkpoint",
    "capture_rng",
    "checkpoint_dir",
    "default_model_path",
    "eval_batches",
    "export_gguf_lora",
    "export_merged",
    "generate",
    "job_config",
    "known_plan",
    "latest_checkpoint",
    "list_checkpoints",
    "load_adapter",
    "load_bundle",
    "load_model",
    "lr_at",
    "malloc_in_use",
    "model_hash_of_folder",
    "open_frozen_linears",
    "plan_job",
    "plans_here",
    "portable_base_name",
    "prepare",
    "prepare_main",
    "read_config",
    "read_weights",
    "resolve",
    "resolve_backend",
    "resolve_precision",
    "restore_rng",
    "run_recipe",
    "save_adapter",
    "seed_everything",
    "trim_tail",
    "warm_up",
]
