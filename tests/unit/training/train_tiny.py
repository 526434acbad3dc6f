"""Tiny stand-ins with the model and tokenizer interfaces the trainer codes against (fast, deterministic)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lorad.server.engine.training.data import ChatSample, Message, TextSample
from torch import nn

VOCAB = 64
EOS, IM_START, IM_END = 0, 1, 2


class CharTokenizer:
    """Byte-ish tokenizer with a ChatML-like template; assistant content + end marker are the trained tokens."""

    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        return [3 + (ord(c) % (VOCAB - 3)) for c in text]

    def render_chat(self, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        mask: list[bool] = []
        for m in messages:
            head = [IM_START, *self.encode(m["role"] + "\n")]
            body = [*self.encode(m["content"]), IM_END]
            ids += head + body
            mask += [False] * len(head) + [m["role"] == "assistant"] * len(body)
        return ids, mask


class TinyLoraLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randn(d_out, d_in) / d_in**0.5)
        self.lora_A = nn.Parameter(torch.randn(rank, d_in) / d_in**0.5)
        self.lora_B = nn.Parameter(torch.randn(d_out, rank) * 0.01)  # nonzero so both factors get gradients
        self.scale = alpha / rank
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.scale * (self.drop(x) @ self.lora_A.T) @ self.lora_B.T


class TinyLM(nn.Module):
    """Residual MLP language model: frozen embedding (tied head), `layers` blocks of two LoRA linears."""

    def __init__(self, dim: int = 16, layers: int = 3, rank: int = 4, alpha: float = 8.0, dropout: float = 0.0):
        super().__init__()
        self.register_buffer("embed", torch.randn(VOCAB, dim))
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "up_proj": TinyLoraLinear(dim, 2 * dim, rank, alpha, dropout),
                    "down_proj": TinyLoraLinear(2 * dim, dim, rank, alpha, dropout),
                }
            )
            for _ in range(layers)
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed[input_ids]
        for b in self.blocks:
            h = h + b["down_proj"](F.silu(b["up_proj"](F.rms_norm(h, (h.shape[-1],)))))
        logits = F.rms_norm(h, (h.shape[-1],)) @ self.embed.T
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)

    def lora_groups(self) -> list[tuple[str, list[nn.Parameter]]]:
        return [(f"layers.{i}", list(b.parameters())) for i, b in enumerate(self.blocks)]

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if "lora_" in k}

    def load_lora_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _missing, unexpected = self.load_state_dict(state, strict=False)
        assert not unexpected, unexpected


WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "rain",
    "fell",
    "over",
    "quiet",
    "hills",
    "and",
    "a",
    "dog",
    "ran",
    "past",
    "old",
    "stone",
    "walls",
    "near",
    "the",
    "sea",
    "every",
    "morning",
    "bread",
    "is",
    "baked",
    "before",
    "light",
]


def corpus(n: int, seed: int = 0) -> list[TextSample | ChatSample]:
    """A deterministic mix of text and chat samples of varying length."""
    g = torch.Generator().manual_seed(seed)
    out: list[TextSample | ChatSample] = []
    for i in range(n):
        k = int(torch.randint(3, 14, (1,), generator=g))
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (k,), generator=g)]
        if i % 3 == 2:
            out.append(ChatSample((Message("user", " ".join(words[:3])), Message("assistant", " ".join(words[3:])))))
        else:
            out.append(TextSample(f"{i} " + " ".join(words)))
    return out


def make_trainer(cfg, ckpt_dir=None, n_samples: int = 60, **kw):  # type: ignore[no-untyped-def]
    """A Trainer over TinyLM and the tiny corpus; the adapter init is seeded by cfg.seed."""
    from lorad.server.engine.training.data import prepare
    from lorad.server.engine.training.trainer import Trainer

    torch.manual_seed(cfg.seed)
    model = TinyLM(rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout)
    data = prepare(corpus(n_samples), CharTokenizer(), seq_len=cfg.seq_len, eval_fraction=cfg.eval_fraction)
    return Trainer(model, cfg, data, pad_id=EOS, checkpoint_dir=ckpt_dir, **kw)
