"""Builds a CausalLM from HF-named weights: every linear becomes a lorad kernel FrozenLinear + LoRALinear."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor

from lorad.kernels import LoRALinear, fused, make_frozen_linear
from lorad.kernels.cpu_threads import torch_threads_for
from lorad.server.engine.models.config import LoraConfig, ModelConfig
from lorad.server.engine.models.heap import release_free_heap
from lorad.server.engine.models.model import MLP, Attention, Block, CausalLM, Linear

log = structlog.get_logger(__name__)


def layer_precision(precision: Any, name: str) -> tuple[str, str | None]:
    """(forward, backward) precision for layer `name` from a single precision string or a PrecisionPlan."""
    if isinstance(precision, str):
        return precision, None
    # lorad.kernels.PrecisionPlan has precisions(); plans with for_layer() (e.g. prepared bundles) work too.
    fwd, bwd = precision.precisions(name) if hasattr(precision, "precisions") else precision.for_layer(name)
    return str(fwd), (None if bwd is None else str(bwd))


def shared_head_weight(frozen: Any, like: Tensor) -> Tensor | None:
    """A zero-copy fp32 (or bf16) view of the weight a CPU FrozenLinear holds, if one equals `like` in shape.

    lorad.kernels has no public accessor for this, so the known storage of the CPU backends is looked up (ort-cpu's
    numpy buffer, torch's fp32 store); anything else returns None and the caller keeps its own copy. The view is
    only read (embedding lookups), never written.
    """
    cand: Any = None
    arrays = getattr(frozen, "_arrays", None)  # OrtCpuFrozenLinear: {"fp32": np.ndarray [out, in], ...}
    if isinstance(arrays, dict) and "fp32" in arrays:
        cand = torch.from_numpy(arrays["fp32"])
    store = getattr(frozen, "_store", None)  # TorchFrozenLinear: {"fp32": (Tensor, None), "bf16": ...}
    for p in ("fp32", "bf16"):
        if cand is None and isinstance(store, dict) and p in store:
            cand = store[p][0]
    dtypes = (torch.float32, torch.bfloat16)
    if not isinstance(cand, Tensor) or cand.dtype not in dtypes or tuple(cand.shape) != tuple(like.shape):
        return None
    return cand if cand.is_contiguous() else None


def build_model(
    cfg: ModelConfig,
    weights: Mapping[str, Tensor],
    *,
    backend: str = "torch",
    precision: Any = "fp32",
    lora: LoraConfig | None = None,
    cache_dir: Path | None = None,
    model_hash: str = "",
) -> CausalLM:
    """Creates the model on a kernel backend.

    Args:
        cfg: Architecture.
        weights: HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...); any float dtype.
        backend: lorad.kernels backend name ("torch", "ort-cpu", "qnn-htp").
        precision: One precision for every linear ("fp32", "fp16", "w8a16", "w8a8") or a
            lorad.kernels PrecisionPlan (`precisions(name) -> (fwd, bwd)`, names as HF modules and "lm_head").
        lora: Adapter shape, or None for a base-only model (no trainable parameters).
        cache_dir: Backend cache (QNN EP contexts).
        model_hash: Base model content hash (part of backend cache keys).

    Returns:
        The CausalLM; its only parameters are the LoRA A/B tensors.

    Raises:
        KeyError: A weight the architecture needs is missing (its name is in the message).
    """

    def stored(key: str) -> Tensor:
        """The weight as stored: the backends convert it themselves, so no full-size fp32 copy is made first
        (Qwen2-0.5B's bf16 embedding would be a 545 MB one)."""
        if key not in weights:
            raise KeyError(f"weight {key!r} missing from the checkpoint (arch={cfg.arch})")
        return weights[key].detach().contiguous()

    def w(key: str) -> Tensor:
        return stored(key).to(torch.float32)

    fused.kernels()  # loaded (or built, once per machine) with the model, not in the first training step
    targets = set(lora.targets) if lora else set()

    def linear(name: str, bias: bool = False) -> Linear:
        fwd, bwd = layer_precision(precision, name)
        frozen = make_frozen_linear(
            stored(name + ".weight"),
            w(name + ".bias") if bias else None,
            backend=backend,
            precision=fwd,
            precision_bwd=bwd,
            name=name,
            cache_dir=cache_dir,
            model_hash=model_hash,
        )
        rank = lora.rank if lora and name.rsplit(".", 1)[-1] in targets else 0
        mod = LoRALinear(frozen, rank, lora.alpha if lora else 1.0, lora.dropout if lora else 0.0)
        return Linear(frozen, mod, name, rank)

    blocks = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        norms = {"q_norm": w(f"{a}.q_norm.weight"), "k_norm": w(f"{a}.k_norm.weight")} if cfg.qk_norm else {}
        attn = Attention(
            cfg,
            linear(f"{a}.q_proj", cfg.attn_bias),
            linear(f"{a}.k_proj", cfg.attn_bias),
            linear(f"{a}.v_proj", cfg.attn_bias),
            linear(f"{a}.o_proj"),
            norms=norms,
        )
        mlp = MLP(linear(f"{p}.mlp.gate_proj"), linear(f"{p}.mlp.up_proj"), linear(f"{p}.mlp.down_proj"))
        norm_in, norm_post = w(f"{p}.input_layernorm.weight"), w(f"{p}.post_attention_layernorm.weight")
        blocks.append(Block(cfg, attn, mlp, norm_in, norm_post))
        blocks[-1].stack_frozen()
        # Quantizing and widening leave freed float blocks behind; given back per block, Qwen2-0.5B's build at w8a8
        # peaked at 1.38 instead of 1.79 GB.
        release_free_heap()
    embed = stored("model.embed_tokens.weight")
    head_key = "model.embed_tokens" if cfg.tie_embeddings or "lm_head.weight" not in weights else "lm_head"
    fwd, bwd = layer_precision(precision, "lm_head")
    head_frozen = make_frozen_linear(
        embed if head_key == "model.embed_tokens" else stored("lm_head.weight"),
        None,
        backend=backend,
        precision=fwd,
        precision_bwd=bwd,
        name="lm_head",
        cache_dir=cache_dir,
        model_hash=model_hash,
    )
    head = Linear(head_frozen, LoRALinear(head_frozen, 0, 1.0), "lm_head", 0)
    # One fp32 table when the backend's head holds a plain fp32 copy of the same tensor: the lookup reads it (113 MB
    # saved on SmolLM2). Otherwise the lookup table is a separate copy; when the head itself is reduced-precision,
    # fp16 rows (half the bytes: 57 MB instead of 113 MB for SmolLM2) lose nothing that matters.
    shared = shared_head_weight(head_frozen, embed) if head_key == "model.embed_tokens" else None
    if shared is not None:
        embed = shared
    elif fwd != "fp32":
        embed = embed.to(torch.float16)
    else:
        embed = embed.to(torch.float32)
    model = CausalLM(cfg, lora, embed=embed, layers=blocks, norm=w("model.norm.weight"), lm_head=head)
    model.torch_threads = torch_threads_for(backend)
    log.info(
        "model_built",
        arch=cfg.arch,
        layers=cfg.num_layers,
        backend=backend,
        lora_rank=lora.rank if lora else 0,
        lora_params=sum(p.numel() for p in model.parameters()),
    )
    return model
