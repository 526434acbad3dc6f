"""LoRA adapters: PEFT-format save/load with provenance, base checks, GGUF LoRA and merged-model exports.

Public surface:
- ``Adapter`` (lora config + PEFT-named tensors + ``AdapterMetadata``); ``Adapter.from_model``, ``.weights()``
  (inference weights for generation), ``.check_base(model_hash, tokenizer_hash)``
- ``save_adapter(path, adapter)``, ``load_adapter(path)``,
  ``apply_adapter(model, adapter, model_hash=, tokenizer_hash=)``
- ``AdapterBaseMismatchError``: raised when an adapter meets a different base model or tokenizer
- ``export_gguf_lora(adapter, path, cfg)``: llama.cpp LoRA; ``export_merged(base_dir, adapter, out_dir)``: merged model
- crash-safe writes use ``lorad.server.engine.models.atomic`` (temp -> fsync -> rename)
"""

from lorad.server.engine.adapters.gguf_lora import export_gguf_lora
from lorad.server.engine.adapters.merge import export_merged, merge_weights
from lorad.server.engine.adapters.metadata import AdapterMetadata
from lorad.server.engine.adapters.peft_io import (
    Adapter,
    AdapterBaseMismatchError,
    apply_adapter,
    load_adapter,
    peft_config,
    save_adapter,
)

__all__ = [
    "Adapter",
    "AdapterBaseMismatchError",
    "AdapterMetadata",
    "apply_adapter",
    "export_gguf_lora",
    "export_merged",
    "load_adapter",
    "merge_weights",
    "peft_config",
    "save_adapter",
]
