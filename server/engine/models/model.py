"""Llama / Qwen2 / Qwen3 decoder whose every linear is a frozen lorad kernel plus an optional LoRA adapter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lorad.kernels import LoRALinear
from lorad.kernels.capabilities import cpu_bf16
from lorad.kernels.lora_group import groupable, shared_input_lora
from lorad.kernels.rmsnorm import RMSNorm
from lorad.kernels.torch_backend import TorchFrozenLinear, stack_bf16
from lorad.server.engine.models.attention import causal_attention_bf16, causal_attention_f32, squares_fit
from lorad.server.engine.models.config import TARGET_TO_HF, LoraConfig, ModelConfig
from lorad.server.engine.models.kv_cache import KVCache
from lorad.server.engine.models.layers import (
    linear_cross_entropy,
    rms_norm,
    rope_heads,
    rope_inv_freq,
    swiglu,
)
from lorad.server.engine.models.mlp import fusable, lora_swiglu


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter held outside the model (for inference): HF module name -> (A [r,in], B [out,r]), scale."""

    tensors: Mapping[str, tuple[Tensor, Tensor]]
    scale: float


class QueuedMatmul:
    """A FrozenLinear whose calls run on the kernels' NpuQueue worker (so backend calls stay serialised)."""

    def __init__(self, frozen: Any, queue: Any) -> None:
        self.frozen, self.queue = frozen, queue
        self.in_features, self.out_features = frozen.in_features, frozen.out_features

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.queue.submit(self.frozen.forward, x).result()
        return out

    def input_grad(self, dy: Tensor) -> Tensor:
        out: Tensor = self.queue.submit(self.frozen.input_grad, dy).result()
        return out


OWN = "own"
"""Sentinel for `adapter=`: use the model's own (trainable) LoRA parameters."""


class Linear(nn.Module):
    """One frozen projection (kernel backend) with a LoRA path; `name` is the HF module name."""

    def __init__(self, frozen: Any, lora: LoRALinear, name: str, rank: int) -> None:
        super().__init__()
        self.frozen = frozen  # lorad.kernels FrozenLinear; not an nn.Module, owns the backend weights
        self.lora = lora
        self.name = name
        self.rank = rank
        self.out_features = int(frozen.out_features)

    def forward(self, x: Tensor, adapter: AdapterWeights | str | None = OWN) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if adapter == OWN:
            y = self.lora(x2)
        else:
            x2 = x2.float()  # the bf16 training attention hands o_proj bf16 rows (attention.py)
            y = self._frozen_forward(x2.contiguous())
            if isinstance(adapter, AdapterWeights) and self.name in adapter.tensors:
                a, b = adapter.tensors[self.name]
                y = y + adapter.scale * ((x2 @ a.t()) @ b.t())
        return y.view(*x.shape[:-1], self.out_features)

    def _frozen_forward(self, x2: Tensor) -> Tensor:
        if isinstance(self.frozen, TorchFrozenLinear):  # plain torch is thread-safe: skip the ~60 us queue hop
            return self.frozen.forward(x2)
        # Through the backend queue: NPU calls stay serialised even while a training job runs.
        out: Tensor = self.lora.queue.submit(self.frozen.forward, x2).result()
        return out


class Attention(nn.Module):
    """Grouped-query attention with RoPE (and per-head q/k RMSNorm for Qwen3)."""

    q_norm: Tensor
    k_norm: Tensor

    def __init__(self, cfg: ModelConfig, q: Linear, k: Linear, v: Linear, o: Linear, *, norms: dict[str, Tensor]):
        super().__init__()
        self.cfg = cfg
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q, k, v, o
        if cfg.qk_norm:
            self.register_buffer("q_norm", norms["q_norm"], persistent=False)
            self.register_buffer("k_norm", norms["k_norm"], persistent=False)

    def _bf16_attention(self) -> bool:
        """Training attention runs its products in bf16 (attention.py) when this layer's frozen products already run
        below fp32 on a CPU with bf16 dot products; an fp32 job (and the planner's fp32 reference) stays fp32."""
        return self.q_proj.frozen.precision_fwd != "fp32" and cpu_bf16().native

    def forward(  # noqa: PLR0917 (hot path: positional args keep the per-layer call cheap)
        self, x: Tensor, norm: RMSNorm, cos: Tensor, sin: Tensor, cache: KVCache | None, layer: int, adapter: Any
    ) -> Tensor:
        """Attention over ``rms_norm(x)`` with ``norm`` = (weight, eps): the block's input norm, applied here so the
        grouped q/k/v node can keep x instead of the normed rows (lora_group.normed_rows)."""
        cfg = self.cfg
        b, t, _ = x.shape
        qkv = (self.q_proj.lora, self.k_proj.lora, self.v_proj.lora)
        if adapter == OWN and groupable(qkv):  # one node for the three products of one input (lora_group.py)
            q, k, v = shared_input_lora(qkv, x, norm)
        else:
            x = rms_norm(x, *norm)
            q, k, v = self.q_proj(x, adapter), self.k_proj(x, adapter), self.v_proj(x, adapter)
        q = q.view(b, t, cfg.num_heads, cfg.head_dim)
        k = k.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm, cfg.rms_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_eps)
        causal = cache is None and t > 1  # a whole sequence at once: training, eval, a prompt without a cache
        if causal and torch.is_grad_enabled() and self._bf16_attention() and squares_fit(b, cfg.num_heads, t):
            # training: q and k rotated straight into bf16 [B, H, T, hd]; bf16 GEMMs, fp32 softmax, bf16 [B, T, H*D]
            # rows out (eval, generation and sequences too long for its [T, T] squares: below)
            qb, kb = rope_heads(q, cos, sin, bf16=True), rope_heads(k, cos, sin, bf16=True)
            return self.o_proj(causal_attention_bf16(qb, kb, v.transpose(1, 2)), adapter)
        q, k, v = rope_heads(q, cos, sin), rope_heads(k, cos, sin), v.transpose(1, 2)  # [B, H, T, hd]
        if causal:  # fp32 training and eval: the fused kernels' rows for o_proj, where they run
            rows = causal_attention_f32(q, k, v)
            if rows is not None:
                return self.o_proj(rows, adapter)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(layer, k, v)
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
        elif t == 1:  # one new token attends to everything cached
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:  # chunk after a prefix: causal mask aligned to the bottom-right
            s = k.shape[2]
            mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, cfg.num_heads * cfg.head_dim), adapter)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down

    def forward(self, x: Tensor, norm: RMSNorm, adapter: Any) -> Tensor:
        """The feed-forward of ``rms_norm(x)``, ``norm`` = (weight, eps) applied inside the fused node (see
        Attention.forward)."""
        layers = (self.gate_proj.lora, self.up_proj.lora, self.down_proj.lora)
        if adapter == OWN and fusable(*layers):  # one node: 2.2 (bf16) or 3.7 MB saved, its norm included
            return lora_swiglu(*layers, x, norm)
        x = rms_norm(x, *norm)
        return self.down_proj(swiglu(self.gate_proj(x, adapter), self.up_proj(x, adapter)), adapter)


class Block(nn.Module):
    """Pre-norm transformer block."""

    input_layernorm: Tensor
    post_attention_layernorm: Tensor

    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: MLP, in_norm: Tensor, post_norm: Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.self_attn, self.mlp = attn, mlp
        self.register_buffer("input_layernorm", in_norm, persistent=False)
        self.register_buffer("post_attention_layernorm", post_norm, persistent=False)

    def stack_frozen(self) -> int:
        """Stacks the bf16 weights of the projections that read one input, q/k/v and gate/up, so each group runs
        one GEMM a direction (``torch_backend.stack_bf16``; the same bytes). Returns how many groups were stacked."""
        a, m = self.self_attn, self.mlp
        groups = ((a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj))
        return sum(stack_bf16([lin.frozen for lin in g]) for g in groups)

    def forward(  # noqa: PLR0917 (hot path)
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None, layer: int, adapter: Any
    ) -> Tensor:
        eps = self.cfg.rms_eps
        x = x + self.self_attn(x, (self.input_layernorm, eps), cos, sin, cache, layer, adapter)
        return x + self.mlp(x, (self.post_attention_layernorm, eps), adapter)


class CausalLM(nn.Module):
    """The decoder. Build it with `lorad.server.engine.models.build.build_model`; only LoRA tensors are parameters."""

    embed_tokens: Tensor
    norm: Tensor
    inv_freq: Tensor

    def __init__(
        self,
        cfg: ModelConfig,
        lora: LoraConfig | None,
        *,
        embed: Tensor,
        layers: list[Block],
        norm: Tensor,
        lm_head: Linear,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.lora_config = lora
        self.register_buffer("embed_tokens", embed, persistent=False)  # [V, D] fp32 (fp16 w/ quantized head), CPU
        self.layers = nn.ModuleList(layers)
        self.register_buffer("norm", norm, persistent=False)
        self.lm_head = lm_head  # rank-0 Linear on the kernel backend (tied to embed_tokens when cfg says so)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._rope: tuple[Tensor, Tensor] = (torch.empty(0), torch.empty(0))
        # Tokens per logits chunk in the loss: chunk x V x 4 B of fp32 scratch plus its bf16 copies. 64 instead of 256
        # cut SmolLM2's peak RSS by 70-80 MB (1185/1165 -> 1102/1106 MB) at the same step time (paired interleaved
        # steps: 0.98x, inside the noise). A torch bf16 head blocks its rows its own way (layers._BF16_HEAD_ROWS).
        self.loss_chunk = 64
        # torch intra-op threads while this model trains/evaluates (0 = leave torch's setting alone). build_model
        # sets 1 on ort-cpu unless torch's idle OpenMP workers sleep (kernels.cpu_threads): spinning, they hold the
        # cores ORT's own pool runs the frozen products on.
        self.torch_threads = 0

    def _rope_tables(self, start: int, t: int) -> tuple[Tensor, Tensor]:
        need = start + t
        if self._rope[0].shape[0] < need:
            n = max(need, 2 * self._rope[0].shape[0], 256)
            freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope = (emb.cos(), emb.sin())
        return self._rope[0][start:need], self._rope[1][start:need]

    def stack_frozen(self) -> int:
        """``Block.stack_frozen`` for every block (after a plan re-lowered layers); returns the groups stacked."""
        return sum(blk.stack_frozen() for blk in self.layers if isinstance(blk, Block))

    def hidden(self, input_ids: Tensor, cache: KVCache | None = None, adapter: Any = OWN) -> Tensor:
        """Final-norm hidden states [B, T, D] for input_ids [B, T] (appending to `cache` when given)."""
        start = cache.length if cache is not None else 0
        cos, sin = self._rope_tables(start, input_ids.shape[1])
        x = F.embedding(input_ids, self.embed_tokens).float()
        for i, blk in enumerate(self.layers):
            x = blk(x, cos, sin, cache, i, adapter)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return rms_norm(x, self.norm, self.cfg.rms_eps)

    def forward(self, input_ids: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
        """Next-token cross-entropy.

        Args:
            input_ids: Token ids [B, T].
            labels: Targets aligned with input_ids [B, T] (HF convention: shifted inside, so labels[t] is
                predicted from position t-1); -100 marks positions without loss.
            reduction: "mean" over labelled tokens or "sum".

        Returns:
            Scalar loss tensor (differentiable w.r.t. the LoRA parameters).
        """
        h = self.hidden(input_ids)[:, :-1].reshape(-1, self.cfg.hidden_size)
        tgt = labels[:, 1:].reshape(-1)
        head = QueuedMatmul(self.lm_head.frozen, self.lm_head.lora.queue)
        return linear_cross_entropy(h, tgt, head, chunk=self.loss_chunk, reduction=reduction)

    def logits(
        self,
        input_ids: Tensor,
        *,
        cache: KVCache | None = None,
        adapter: AdapterWeights | str | None = OWN,
        last_only: bool = False,
    ) -> Tensor:
        """Vocabulary logits [B, T, V] (or [B, V] with last_only) for inference.

        Args:
            input_ids: Token ids [B, T].
            cache: KV cache to read and extend (generation); None for a full forward.
            adapter: OWN (the model's LoRA parameters), an AdapterWeights, or None for the base model.
            last_only: Project only the last position (generation).
        """
        h = self.hidden(input_ids, cache, adapter)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(h, None).squeeze(1) if last_only else self.lm_head(h, None)

    def lora_modules(self) -> list[Linear]:
        """All adapted linears, first layer to last, in q,k,v,o,gate,up,down order."""
        out = []
        for blk in self.layers:
            for sub, proj in TARGET_TO_HF.values():
                lin = getattr(getattr(blk, sub), proj)
                if lin.rank > 0:
                    out.append(lin)
        return out

    def lora_groups(self) -> list[tuple[str, list[nn.Parameter]]]:
        """Per-layer LoRA parameters, ordered from the first layer to the last.

        The trainer steps a layer's group as soon as backward has produced all its gradients (the last layer's
        grads are final first).
        """
        groups = []
        for i, blk in enumerate(self.layers):
            params = [p for _, p in blk.named_parameters() if p.requires_grad]
            if params:
                groups.append((f"model.layers.{i}", params))
        return groups

    def lora_state_dict(self) -> dict[str, Tensor]:
        """LoRA tensors under PEFT key names (`base_model.model.<module>.lora_A.weight`), detached copies."""
        sd = {}
        for lin in self.lora_modules():
            sd[f"base_model.model.{lin.name}.lora_A.weight"] = lin.lora.lora_A.detach().clone()
            sd[f"base_model.model.{lin.name}.lora_B.weight"] = lin.lora.lora_B.detach().clone()
        return sd

    def load_lora_state_dict(self, sd: Mapping[str, Tensor]) -> None:
        """Copies PEFT-named LoRA tensors into the model's parameters.

        Raises:
            KeyError: A tensor is missing or unexpected (names listed), or a shape differs.
        """
        own = self.lora_state_dict()
        missing = sorted(set(own) - set(sd))
        extra = sorted(set(sd) - set(own))
        if missing or extra:
            raise KeyError(f"LoRA state dict mismatch: missing {missing[:4]}, unexpected {extra[:4]}")
        with torch.no_grad():
            for lin in self.lora_modules():
                for part in ("lora_A", "lora_B"):
                    src = sd[f"base_model.model.{lin.name}.{part}.weight"]
                    dst = getattr(lin.lora, part)
                    if tuple(src.shape) != tuple(dst.shape):
                        raise KeyError(f"{lin.name}.{part}: shape {tuple(src.shape)} != model {tuple(dst.shape)}")
                    dst.copy_(src)

    def own_adapter(self) -> AdapterWeights | None:
        """Snapshot of the model's LoRA parameters as an AdapterWeights (for generation)."""
        if self.lora_config is None:
            return None
        t = {
            lin.name: (lin.lora.lora_A.detach().clone(), lin.lora.lora_B.detach().clone())
            for lin in self.lora_modules()
        }
        return AdapterWeights(t, self.lora_config.scale)
