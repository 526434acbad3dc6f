"""Training samples (text and chat), their tokenization with loss masks, the held-out split and the data report."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    """One chat turn."""

    role: str
    content: str


@dataclass(frozen=True)
class TextSample:
    """Plain text; every token is trained on."""

    text: str


@dataclass(frozen=True)
class ChatSample:
    """A conversation; only assistant tokens are trained on."""

    messages: tuple[Message, ...]


Sample = TextSample | ChatSample


class ChatTokenizer(Protocol):
    """What the data pipeline needs from the model's tokenizer wrapper."""

    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        """Token ids of the chat template applied to `messages` and a mask that is True on assistant tokens."""
        ...


class DataError(ValueError):
    """No usable training data; carries the report that says why."""

    def __init__(self, message: str, report: DataReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class TokenizedSample:
    """A rendered sample: token ids, loss mask (True = trained on) and its content hash."""

    sample_hash: str
    ids: tuple[int, ...]
    mask: tuple[bool, ...]
    is_chat: bool


@dataclass(frozen=True)
class Rejection:
    """An unusable sample: its index in the input, content hash and reason."""

    index: int
    sample_hash: str
    reason: str
    detail: str


@dataclass
class DataReport:
    """What happened to every input sample; counts and hashes only, never sample text."""

    total: int = 0
    train_samples: int = 0
    eval_samples: int = 0
    train_tokens: int = 0
    eval_tokens: int = 0
    train_target_tokens: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    rejections: list[Rejection] = field(default_factory=list)

    @property
    def rejected_total(self) -> int:
        """Number of unusable samples."""
        return sum(self.rejected.values())

    def to_dict(self) -> dict[str, object]:
        """A JSON-friendly summary (rejection reasons with counts, first 100 rejections)."""
        return {
            "total": self.total,
            "train_samples": self.train_samples,
            "eval_samples": self.eval_samples,
            "train_tokens": self.train_tokens,
            "eval_tokens": self.eval_tokens,
            "train_target_tokens": self.train_target_tokens,
            "rejected": dict(self.rejected),
            "rejections": [r.__dict__ for r in self.rejections[:100]],
        }


@dataclass(frozen=True)
class PreparedData:
    """Tokenized train and held-out samples plus the report."""

    train: list[TokenizedSample]
    eval: list[TokenizedSample]
    report: DataReport

    @property
    def fingerprint(self) -> str:
        """Hash of the ordered train set; a checkpoint's data cursor is only valid for the same fingerprint."""
        h = hashlib.sha256()
        for s in self.train:
            h.update(s.sample_hash.encode())
        return h.hexdigest()


def sample_hash(sample: Sample) -> str:
    """SHA-256 of a sample's canonical JSON content (stable across processes and input order)."""
    if isinstance(sample, TextSample):
        obj: object = {"type": "text", "text": sample.text}
    elif isinstance(sample, ChatSample):
        obj = {"type": "chat", "messages": [[m.role, m.content] for m in sample.messages]}
    else:
        obj = {"type": "unknown", "repr": repr(sample)}
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def is_eval(h: str, eval_fraction: float) -> bool:
    """Whether a sample with content hash `h` belongs to the held-out split.

    The split depends only on the hash, so appending samples never moves old ones between train and eval.
    """
    return int(h[:16], 16) / float(1 << 64) < eval_fraction


class _RejectError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def _render(sample: Sample, tok: ChatTokenizer) -> tuple[list[int], list[bool], bool]:
    if isinstance(sample, TextSample):
        if not isinstance(sample.text, str) or not sample.text.strip():
            raise _RejectError("empty", "text is empty or whitespace")
        eos = [] if tok.eos_id is None else [int(tok.eos_id)]
        ids = [*tok.encode(sample.text), *eos]
        return ids, [True] * len(ids), False
    if isinstance(sample, ChatSample):
        if not sample.messages:
            raise _RejectError("empty", "conversation has no messages")
        for i, m in enumerate(sample.messages):
            if not isinstance(m, Message) or m.role not in ROLES:
                role = getattr(m, "role", None)
                raise _RejectError("bad_role", f"message {i} has role {role!r}; allowed roles: {ROLES}")
        if not any(m.role == "assistant" for m in sample.messages):
            raise _RejectError("no_assistant_turn", "conversation has no assistant message to learn from")
        try:
            ids, mask = tok.render_chat([{"role": m.role, "content": m.content} for m in sample.messages])
        except Exception as e:
            raise _RejectError("render_error", f"chat template failed: {type(e).__name__}") from None
        return list(ids), [bool(b) for b in mask], True
    raise _RejectError("bad_sample_type", f"expected TextSample or ChatSample, got {type(sample).__name__}")


def prepare(
    samples: Sequence[Sample],
    tok: ChatTokenizer,
    *,
    seq_len: int,
    eval_fraction: float,
    max_tokens: int | None = None,
) -> PreparedData:
    """Tokenizes samples, masks non-assistant tokens, splits train/eval by hash and reports unusable samples.

    A chat sample must fit in one packed sequence (`seq_len` tokens) so its answer keeps its prompt; a text sample
    may be longer and is split across sequences, up to `max_tokens` (default 32 × seq_len).

    Args:
        samples: the job's samples in store order.
        tok: tokenizer wrapper (encode, render_chat, eos_id).
        seq_len: packed sequence length in tokens.
        eval_fraction: share of samples (by hash) held out for eval loss; when it is > 0 and the split holds out
            nothing, one sample is held out anyway if at least two are usable.
        max_tokens: longest accepted sample in tokens.

    Returns:
        The tokenized splits and a report.

    Raises:
        DataError: no usable training sample is left.
    """
    limit = max_tokens if max_tokens is not None else 32 * seq_len
    report = DataReport(total=len(samples))
    train: list[TokenizedSample] = []
    held: list[TokenizedSample] = []
    for i, s in enumerate(samples):
        h = sample_hash(s)
        try:
            ids, mask, is_chat = _render(s, tok)
            if len(ids) != len(mask):
                raise _RejectError("render_error", f"mask has {len(mask)} entries for {len(ids)} tokens")
            if not ids:
                raise _RejectError("empty", "no tokens after rendering")
            if not any(mask):
                raise _RejectError("no_target_tokens", "no token is trained on (assistant turns render empty)")
            if is_chat and len(ids) > seq_len:
                raise _RejectError("too_long", f"chat renders to {len(ids)} tokens > seq_len={seq_len}")
            if len(ids) > limit:
                raise _RejectError("too_long", f"sample renders to {len(ids)} tokens > max_tokens={limit}")
        except _RejectError as r:
            report.rejected[r.reason] += 1
            report.rejections.append(Rejection(i, h, r.reason, r.detail))
            continue
        ts = TokenizedSample(h, tuple(ids), tuple(mask), is_chat)
        (held if is_eval(h, eval_fraction) else train).append(ts)
    if eval_fraction > 0 and not held and len(train) >= 2:
        # A tiny data set can leave the hash split empty; hold out the sample nearest to it (smallest hash score)
        # so the job still reports a held-out loss. Deterministic: same samples, same choice.
        nearest = min(range(len(train)), key=lambda j: train[j].sample_hash[:16])
        held.append(train.pop(nearest))
    report.train_samples, report.eval_samples = len(train), len(held)
    report.train_tokens = sum(len(s.ids) for s in train)
    report.eval_tokens = sum(len(s.ids) for s in held)
    report.train_target_tokens = sum(sum(s.mask) for s in train)
    log.info(
        "data_prepared",
        total=report.total,
        train=len(train),
        eval=len(held),
        rejected=dict(report.rejected),
        train_tokens=report.train_tokens,
    )
    if not train:
        raise DataError(
            f"no usable training samples: {report.total} given, rejected {dict(report.rejected)}, "
            f"{len(held)} held out for eval",
            report,
        )
    return PreparedData(train, held, report)
