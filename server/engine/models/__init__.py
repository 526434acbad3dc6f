"""Llama/Qwen models on lorad kernels: config, loading (HF folder, GGUF, cache), tokenizer, generation.

Public surface:
- ``ModelConfig``, ``LoraConfig``, ``LORA_TARGETS`` (config)
- ``build_model(cfg, weights, backend=, precision=, lora=)`` -> ``CausalLM`` (build)
- ``CausalLM``: ``model(ids, labels) -> loss``, ``model.logits(ids)``, ``lora_groups()``, ``lora_state_dict()``,
  ``load_lora_state_dict()``; ``AdapterWeights`` / ``OWN`` select the adapter for inference (model)
- ``KVCache`` (kv_cache)
- ``load_model(source, cache_root=, backend=, precision=, lora=)`` -> ``LoadedModel`` (model, tokenizer, hashes);
  ``resolve`` converts a GGUF once into the cache; ``default_model_path()`` is the bundled SmolLM2 GGUF (loader)
- ``ChatTokenizer``: ``encode``, ``decode``, ``render_chat(messages) -> (ids, assistant_mask)``, ``stop_ids``
"""

from lorad.server.engine.models.build import build_model
from lorad.server.engine.models.config import LORA_TARGETS, LoraConfig, ModelConfig
from lorad.server.engine.models.kv_cache import KVCache
from lorad.server.engine.models.loader import LoadedModel, default_model_path, load_model, resolve
from lorad.server.engine.models.model import OWN, AdapterWeights, CausalLM
from lorad.server.engine.models.tokenizer import ChatTokenizer

__all__ = [
    "LORA_TARGETS",
    "OWN",
    "AdapterWeights",
    "CausalLM",
    "ChatTokenizer",
    "KVCache",
    "LoadedModel",
    "LoraConfig",
    "ModelConfig",
    "build_model",
    "default_model_path",
    "load_model",
    "resolve",
]
