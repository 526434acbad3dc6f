"""Decoder-only transformer configuration for the Llama and Qwen families."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Hugging Face names of the linear layers a LoRA adapter may target (PEFT's ``target_modules``)."""

# Target -> (HF submodule, HF projection name), in block order.
TARGET_TO_HF = {t: ("self_attn" if t in LORA_TARGETS[:4] else "mlp", t) for t in LORA_TARGETS}
# The short names lorad wrote before it used HF names everywhere (adapter metadata, checkpoints, plan-cache keys);
# only ever read, through hf_targets.
LEGACY_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                  "down": "down_proj"}  # fmt: skip


def hf_targets(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as HF module names: a legacy short name (``q`` … ``down``) read from older files is mapped."""
    return tuple(LEGACY_TARGETS.get(n, n) for n in names)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama/Qwen-style decoder (the subset of HF config.json lorad uses)."""

    arch: str = field(default="llama", metadata={"help": "llama | qwen2 | qwen3"})
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, metadata={"help": "HF rope_scaling (llama3 supported)"})
    max_position: int = 8192
    tie_embeddings: bool = True
    attn_bias: bool = field(default=False, metadata={"help": "q/k/v biases (Qwen2/2.5)"})
    qk_norm: bool = field(default=False, metadata={"help": "per-head RMSNorm on q and k (Qwen3)"})
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        errors = []
        if self.arch not in ("llama", "qwen2", "qwen3"):
            errors.append(f"arch={self.arch!r} is not supported; use llama, qwen2 or qwen3")
        if self.num_heads % self.num_kv_heads:
            errors.append(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            errors.append(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                errors.append(f"rope_scaling type {kind!r} is not supported; only llama3")
        if errors:
            raise ValueError("invalid ModelConfig: " + "; ".join(errors))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Builds a config from a Hugging Face config.json dict.

        Args:
            cfg: Parsed config.json.

        Returns:
            The matching ModelConfig.

        Raises:
            ValueError: The model type is not a supported Llama/Qwen variant.
        """
        mtype = cfg.get("model_type", "llama")
        arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(mtype)
        if arch is None:
            raise ValueError(f"model_type={mtype!r} is not supported; use a llama, qwen2 or qwen3 checkpoint")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        theta = cfg.get("rope_theta")
        scaling = cfg.get("rope_scaling")
        # transformers 5 moved rope settings into rope_parameters.
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict):
            theta = rp.get("rope_theta", theta)
            if rp.get("rope_type", "default") != "default":
                scaling = rp
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", arch == "llama")),
            attn_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """Returns a Hugging Face config.json dict that transformers can load."""
        cls_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.arch]
        out: dict[str, Any] = {
            "architectures": [cls_name],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.arch == "llama":
            out["attention_bias"] = self.attn_bias
            out["mlp_bias"] = False
        if self.arch == "qwen3":
            out["attention_bias"] = False
        return out

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as a plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LoraConfig:
    """Which linears get adapters and how big they are."""

    rank: int = field(default=8, metadata={"help": "LoRA rank r"})
    alpha: float = field(default=16.0, metadata={"help": "LoRA alpha; scale = alpha / rank"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input path, training only"})
    targets: tuple[str, ...] = field(default=LORA_TARGETS, metadata={"help": "subset of q_proj … down_proj"})

    def __post_init__(self) -> None:
        errors = []
        if self.rank < 1:
            errors.append(f"rank={self.rank} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            errors.append(f"dropout={self.dropout} must be in [0, 1)")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            errors.append(f"targets {bad} unknown; choose among {','.join(LORA_TARGETS)}")
        if not self.targets:
            errors.append("targets is empty; choose at least one of " + ",".join(LORA_TARGETS))
        if errors:
            raise ValueError("invalid LoraConfig: " + "; ".join(errors))

    @property
    def scale(self) -> float:
        """LoRA output scale alpha / rank (PEFT's default, no rsLoRA)."""
        return self.alpha / self.rank
