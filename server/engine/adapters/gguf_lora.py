"""Exports an adapter as a llama.cpp GGUF LoRA (what `llama-cli --lora` and llama.cpp apps load)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import gguf
import numpy as np
import structlog

from lorad.server.engine.adapters.peft_io import Adapter
from lorad.server.engine.models.atomic import fsync_dir
from lorad.server.engine.models.config import ModelConfig
from lorad.server.engine.models.gguf_read import gguf_name, permute_qk

log = structlog.get_logger(__name__)


def export_gguf_lora(adapter: Adapter, path: Path, cfg: ModelConfig, name: str = "lorad adapter") -> Path:
    """Writes `adapter` in llama.cpp's adapter format (convert_lora_to_gguf.py conventions).

    Layout: general.type=adapter, adapter.type=lora, adapter.lora.alpha; per target tensor
    `blk.N.attn_q.weight.lora_a` [r, in] and `.lora_b` [out, r] in F32 (numpy shapes; GGUF stores them reversed).
    For Llama, lora_b rows of q/k get llama.cpp's rotary permutation, matching the permuted base weights.

    Args:
        adapter: The adapter (PEFT names).
        path: Output .gguf (written to a temp file, fsynced, renamed).
        cfg: Base model architecture (arch name and head counts).
        name: general.name.

    Returns:
        `path`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(str(tmp), cfg.arch)
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(adapter.lora.alpha))
        w.add_name(name)
        for mod, (a, b) in sorted(adapter.weights().tensors.items()):
            base = gguf_name(mod + ".weight")
            a_np = a.float().numpy()
            b_np = b.float().numpy()
            if cfg.arch == "llama" and mod.endswith((".q_proj", ".k_proj")):
                b_np = permute_qk(b_np, cfg.num_heads if mod.endswith(".q_proj") else cfg.num_kv_heads)
            w.add_tensor(base + ".lora_a", np.ascontiguousarray(a_np))
            w.add_tensor(base + ".lora_b", np.ascontiguousarray(b_np))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        tmp.replace(path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("gguf_lora_exported", tensors=2 * len(adapter.weights().tensors))
    return path
