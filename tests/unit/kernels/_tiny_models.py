"""Tiny Llama / Qwen2 reference models whose projections come from a factory (plain LoRA or lorad LoRALinear)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 61
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention: 2 q heads per kv head
    inter: int = 48
    layers: int = 2
    qkv_bias: bool = False  # True = Qwen2
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class PlainLoRA(nn.Module):
    """Reference: F.linear with the frozen weight plus an explicit LoRA branch, all by torch.autograd."""

    def __init__(self, w: Tensor, b: Tensor | None, rank: int, alpha: float) -> None:
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("b", b)
        self.scaling = alpha / rank if rank else 0.0
        self.lora_A = nn.Parameter(torch.zeros(rank, w.shape[1])) if rank else None
        self.lora_B = nn.Parameter(torch.zeros(w.shape[0], rank)) if rank else None

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.w, self.b)
        if self.lora_A is not None:
            y = y + self.scaling * (x @ self.lora_A.t()) @ self.lora_B.t()
        return y


Factory = Callable[[str, Tensor, Tensor | None, int], nn.Module]


def random_weights(cfg: TinyConfig, seed: int = 0) -> dict[str, Tensor]:
    """Random frozen weights (std 0.1 so activations stay O(1) in a 2-layer model)."""
    g = torch.Generator().manual_seed(seed)
    kv = cfg.kv_heads * cfg.head_dim
    shapes = {
        "q_proj": (cfg.hidden, cfg.hidden),
        "k_proj": (kv, cfg.hidden),
        "v_proj": (kv, cfg.hidden),
        "o_proj": (cfg.hidden, cfg.hidden),
        "gate_proj": (cfg.inter, cfg.hidden),
        "up_proj": (cfg.inter, cfg.hidden),
        "down_proj": (cfg.hidden, cfg.inter),
    }
    out: dict[str, Tensor] = {"embed": torch.randn(cfg.vocab, cfg.hidden, generator=g)}
    for layer in range(cfg.layers):
        for n, s in shapes.items():
            out[f"layers.{layer}.{n}.weight"] = torch.randn(*s, generator=g) * 0.1
            if cfg.qkv_bias and n in ("q_proj", "k_proj", "v_proj"):
                out[f"layers.{layer}.{n}.bias"] = torch.randn(s[0], generator=g) * 0.1
    out["lm_head.weight"] = torch.randn(cfg.vocab, cfg.hidden, generator=g) * 0.1
    return out


def _rms(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: Tensor, theta: float) -> Tensor:
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class TinyCausalLM(nn.Module):
    """Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU); Qwen2 when cfg.qkv_bias."""

    def __init__(self, cfg: TinyConfig, weights: dict[str, Tensor], factory: Factory, rank: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding.from_pretrained(weights["embed"], freeze=True)
        self.layers = nn.ModuleList()
        for layer in range(cfg.layers):
            mods = {}
            for n in PROJ_NAMES:
                key = f"layers.{layer}.{n}"
                mods[n] = factory(key, weights[f"{key}.weight"], weights.get(f"{key}.bias"), rank)
            self.layers.append(nn.ModuleDict(mods))
        self.lm_head = factory("lm_head", weights["lm_head.weight"], None, 0)

    def forward(self, ids: Tensor) -> Tensor:
        cfg = self.cfg
        bsz, t = ids.shape
        h = self.embed(ids)
        mask = torch.full((t, t), float("-inf")).triu(1)
        for m in self.layers:
            x = _rms(h)
            q = m["q_proj"](x).view(bsz, t, cfg.heads, cfg.head_dim).transpose(1, 2)
            k = m["k_proj"](x).view(bsz, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            v = m["v_proj"](x).view(bsz, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
            rep = cfg.heads // cfg.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            att = torch.softmax(q @ k.transpose(-1, -2) / cfg.head_dim**0.5 + mask, -1)
            h = h + m["o_proj"]((att @ v).transpose(1, 2).reshape(bsz, t, cfg.hidden))
            x = _rms(h)
            h = h + m["down_proj"](F.silu(m["gate_proj"](x)) * m["up_proj"](x))
        return self.lm_head(_rms(h))


def lm_loss(model: nn.Module, ids: Tensor) -> Tensor:
    """Next-token cross-entropy."""
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
