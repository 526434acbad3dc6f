"""Preallocated per-layer key/value cache for incremental decoding."""

from __future__ import annotations

import torch
from torch import Tensor

from lorad.server.engine.models.config import ModelConfig


class KVCache:
    """Keys/values [B, H_kv, max_len, head_dim] per layer; `length` tokens are filled."""

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int = 1) -> None:
        """Allocates the cache.

        Args:
            cfg: Model architecture.
            max_len: Capacity in tokens (prompt + generated); memory = 2 * layers * B * H_kv * max_len * hd * 4 B.
            batch: Batch size.
        """
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape) for _ in range(cfg.num_layers)]
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Writes new k/v [B, H_kv, t, hd] after the filled part; returns all keys/values so far."""
        t = k.shape[2]
        end = self.length + t
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > capacity {self.max_len}; allocate a larger max_len")
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, t: int) -> None:
        """Marks t more tokens as filled (called once per forward, after all layers)."""
        self.length += t
