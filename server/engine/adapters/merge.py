"""Exports base + adapter as one merged full model (HF safetensors folder that transformers loads)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import structlog
import torch
from safetensors.torch import save_file

from lorad.server.engine.adapters.peft_io import Adapter
from lorad.server.engine.models.atomic import building_dir
from lorad.server.engine.models.cache import read_manifest
from lorad.server.engine.models.hf_folder import SafetensorsWeights, read_weights

log = structlog.get_logger(__name__)

_COPY = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


def merge_weights(base: Mapping[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """W' = W + (alpha/r)·B·A for every adapted projection; other tensors are passed through (float32).

    Raises:
        KeyError: The adapter targets a module the base does not have.
    """
    out = {k: v.float() for k, v in base.items()}
    aw = adapter.weights()
    for mod, (a, b) in aw.tensors.items():
        key = mod + ".weight"
        if key not in out:
            raise KeyError(f"adapter targets {mod!r}, which the base checkpoint lacks")
        out[key] = out[key] + aw.scale * (b.double() @ a.double()).float()  # double: one rounding per weight
    return out


def merged_dtype(base_dir: Path, base: SafetensorsWeights) -> torch.dtype:
    """The precision a merged export is written in: the base's own.

    A Hugging Face folder keeps the dtype its embedding is stored in (bf16, fp16 or fp32); a GGUF base (lorad's
    converted cache entry, stored dequantized as fp32) gives fp16, since quantized weights have no float precision
    of their own and fp16 halves the file (SmolLM2-135M: 538 MB in fp32, 269 MB in fp16).
    """
    manifest = read_manifest(base_dir)
    if manifest is not None and str(manifest.get("source", "")).endswith(".gguf"):
        return torch.float16
    key = "model.embed_tokens.weight" if "model.embed_tokens.weight" in base else next(iter(base))
    dtype = base.stored_dtype(key)
    return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16


def export_merged(base_dir: Path, adapter: Adapter, out_dir: Path) -> Path:
    """Writes the merged model as `out_dir` (model.safetensors + config + tokenizer files), atomically.

    The merge is computed in fp32 (B·A in double) and written in ``merged_dtype`` (config.json says which).

    Args:
        base_dir: The base checkpoint folder (an HF folder or lorad's converted cache entry).
        adapter: Adapter trained on that base (check it with `Adapter.check_base` first).
        out_dir: Output folder (replaced if it exists).

    Returns:
        `out_dir`.
    """
    base = read_weights(base_dir)
    dtype = merged_dtype(base_dir, base)
    merged = merge_weights(base, adapter)
    cfg = json.loads((base_dir / "config.json").read_text())
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in merged:
        merged.pop("lm_head.weight")  # tied: transformers re-ties it to the embedding
    out = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in merged.items()}
    with building_dir(out_dir) as tmp:
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name in _COPY:
            if (base_dir / name).is_file():
                shutil.copyfile(base_dir / name, tmp / name)
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    log.info("merged_model_exported", tensors=len(merged), dtype=cfg["torch_dtype"])
    return out_dir
