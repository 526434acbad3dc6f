"""Llama/Qwen models on lorad kernels: config, loading (HF folder, GGUF, cache), tokenizer, generation.

Modules: ``config`` (ModelConfig, LoraConfig, LORA_TARGETS), ``build`` (build_model → CausalLM), ``model``
(CausalLM: ``model(ids, labels) -> loss``, ``logits``, ``lora_groups``, the LoRA state dict; AdapterWeights / OWN
select the adapter for inference), ``kv_cache``, ``loader`` (load_model; resolve converts a GGUF once into the
cache), ``cache`` (the cache's layout and what is already in it, ``cached_checkpoint``), ``sources`` (where a model
comes from; default_model_path is the bundled SmolLM2 GGUF), ``tokenizer`` (ChatTokenizer), ``generate``. ``config``,
``sources``, ``cache`` and ``hf_folder`` import torch only where they touch a tensor.

The package imports nothing itself: ``lorad.server.engine.api`` is the engine's one public surface, and importing
``models.config`` (as the training config does) must not import torch through this file.
"""
