"""Llama/Qwen models on lorad kernels: config, loading (HF folder, GGUF, cache), tokenizer, generation.

Public surface:
- ``ModelConfig``, ``LoraConfig``, ``LORA_TARGETS`` (config)
- ``build_model(cfg, weights, backend=, precision=, lora=)`` -> ``CausalLM`` (build)
- ``CausalLM``: ``model(ids, labels) -> loss``, ``model.logits(ids)``, ``lora_groups()``, ``lora_state_dict()``,
  ``load_lora_state_dict()``; ``AdapterWeights`` / ``OWN`` select the adapter for inference (model)
- ``KVCache`` (kv_cache)
"""

from lorad.server.models.build import build_model
from lorad.server.models.config import LORA_TARGETS, LoraConfig, ModelConfig
from lorad.server.models.kv_cache import KVCache
from lorad.server.models.model import OWN, AdapterWeights, CausalLM

__all__ = [
    "LORA_TARGETS",
    "OWN",
    "AdapterWeights",
    "CausalLM",
    "KVCache",
    "LoraConfig",
    "ModelConfig",
    "build_model",
]
