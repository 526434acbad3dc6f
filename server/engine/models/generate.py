"""Token-by-token generation with a KV cache: greedy or nucleus sampling, repetition penalty, stop tokens, adapters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import structlog
import torch
from torch import Tensor

from lorad.server.engine.models.kv_cache import KVCache
from lorad.server.engine.models.model import AdapterWeights, CausalLM
from lorad.server.engine.models.tokenizer import ChatTokenizer

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens."""

    max_new_tokens: int = field(default=128, metadata={"help": "generated tokens at most (stop token excluded)"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; >0 divides the logits"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass in (0, 1]"})
    seed: int | None = field(default=None, metadata={"help": "sampling RNG seed (None = nondeterministic)"})
    repetition_penalty: float = field(
        default=1.0,
        metadata={"help": "1 = off; p > 1 divides a positive logit (multiplies a negative one) by p once per time the "
                  "token occurs in the last REPEAT_WINDOW generated tokens"},
    )  # fmt: skip
    stop_ids: tuple[int, ...] = field(default=(), metadata={"help": "extra stop token ids (tokenizer's are added)"})

    def __post_init__(self) -> None:
        errors = []
        if self.max_new_tokens < 1:
            errors.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            errors.append(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            errors.append(f"top_p={self.top_p} must be in (0, 1]")
        if not self.repetition_penalty > 0:
            errors.append(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)")
        if errors:
            raise ValueError("invalid SamplingConfig: " + "; ".join(errors))


@dataclass(frozen=True)
class Token:
    """One generated token: its id, the text it completes (may be "" mid-UTF-8), and why generation ended."""

    id: int
    text: str
    finish_reason: str | None = None  # "stop" (stop token, not emitted as text) | "length" | None


# Generated tokens the repetition penalty looks back over. Per occurrence, so a token repeated k times in a row is
# pushed down by p**k and a loop ("vegan vegan vegan") breaks after a few tokens even when an over-fitted adapter
# prefers it by a wide margin; a window (not the whole output) keeps common words ("the", ",") usable in long answers.
# Prompt tokens are not penalized: an answer may quote its question.
REPEAT_WINDOW = 64


def penalize_repeats(logits: Tensor, recent: list[int], penalty: float) -> Tensor:
    """Logits with each token in ``recent`` pushed down by ``penalty`` per occurrence (CTRL-style, compounding).

    Args:
        logits: next-token logits, shape (vocab,).
        recent: recently generated token ids (duplicates count once each).
        penalty: 1 = unchanged; > 1 discourages repeats.
    """
    if penalty == 1.0 or not recent:
        return logits
    vocab = logits.shape[-1]
    counts = torch.bincount(torch.tensor(recent, dtype=torch.long), minlength=vocab)[:vocab]
    factor = torch.pow(torch.tensor(penalty, dtype=torch.float32), counts.float()).to(logits.dtype)
    return torch.where(logits > 0, logits / factor, logits * factor)


def _pick(logits: Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    if cfg.temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        keep = (sorted_p.cumsum(-1) - sorted_p) < cfg.top_p
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=gen))


def generate_ids(
    model: CausalLM,
    prompt_ids: list[int],
    cfg: SamplingConfig,
    *,
    adapter: AdapterWeights | str | None = None,
    stop_ids: frozenset[int] = frozenset(),
    use_cache: bool = True,
) -> Iterator[int]:
    """Yields generated token ids one at a time (a stop token is yielded last, then generation ends).

    Args:
        model: The model (frozen forward only; no gradients are recorded).
        prompt_ids: Prompt token ids (non-empty).
        cfg: Sampling settings.
        adapter: None (base model), an AdapterWeights (swapped per call, the base stays loaded), or OWN for the
            model's own LoRA parameters.
        stop_ids: Token ids that end generation.
        use_cache: KV cache (True) or a full forward per token (reference for tests).

    Raises:
        ValueError: Empty prompt.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; pass at least one token (e.g. the BOS or a chat-rendered prompt)")
    stops = stop_ids | frozenset(cfg.stop_ids)
    gen = None
    if cfg.temperature > 0:
        gen = torch.Generator()
        gen.manual_seed(cfg.seed if cfg.seed is not None else int(torch.seed()))
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    cache = KVCache(model.cfg, len(prompt_ids) + cfg.max_new_tokens) if use_cache else None
    out: list[int] = []
    with torch.inference_mode():
        step_in = ids
        for _ in range(cfg.max_new_tokens):
            logits = model.logits(step_in, cache=cache, adapter=adapter, last_only=True)[0]
            logits = penalize_repeats(logits, out[-REPEAT_WINDOW:], cfg.repetition_penalty)
            nxt = _pick(logits, cfg, gen)
            out.append(nxt)
            yield nxt
            if nxt in stops:
                return
            new = torch.tensor([[nxt]], dtype=torch.long)
            ids = torch.cat([ids, new], dim=1)
            step_in = new if cache is not None else ids


def generate(
    model: CausalLM,
    tokenizer: ChatTokenizer,
    prompt_ids: list[int],
    cfg: SamplingConfig,
    *,
    adapter: AdapterWeights | str | None = None,
) -> Iterator[Token]:
    """Streams generated tokens with their text pieces (for the Generate RPC).

    Text is decoded incrementally: a piece is released once it forms complete UTF-8 characters, so
    concatenating all `Token.text` gives the decoded completion. The last Token has `finish_reason` set.

    Args:
        model: The model.
        tokenizer: Its tokenizer (stop ids and decoding).
        prompt_ids: Prompt token ids (e.g. `tokenizer.render_chat(msgs, add_generation_prompt=True)[0]`).
        cfg: Sampling settings.
        adapter: None, an AdapterWeights, or OWN.
    """
    out: list[int] = []
    shown = ""
    t0 = time.perf_counter()
    for tid in generate_ids(model, prompt_ids, cfg, adapter=adapter, stop_ids=tokenizer.stop_ids):
        if tid in tokenizer.stop_ids or tid in cfg.stop_ids:
            yield Token(tid, "", "stop")
            break
        out.append(tid)
        text = tokenizer.decode(out)
        piece = "" if text.endswith("\ufffd") else text[len(shown) :]
        shown += piece
        if len(out) == cfg.max_new_tokens:
            yield Token(tid, piece + (text[len(shown) :] if piece == "" else ""), "length")
            break
        yield Token(tid, piece)
    dt = time.perf_counter() - t0
    log.info(
        "generation_done",
        prompt_tokens=len(prompt_ids),
        new_tokens=len(out),
        tokens_per_s=round(len(out) / dt, 1) if dt > 0 else None,
        adapter=adapter is not None,
    )
