"""Builds lorad.v1 requests from SDK arguments (shared by the async client and the sync facade)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from lorad.client import _convert as conv
from lorad.client import types as t
from lorad.v1 import common_pb2, inference_pb2

# AppendSamples takes at most 1,000 samples and 16 MiB per request; stay under both with room for framing.
MAX_BATCH_SAMPLES = 1000
MAX_BATCH_BYTES = 8 * 1024 * 1024


def as_sample(item: t.Sample | str | dict[str, Any]) -> t.Sample:
    """Accepts a Sample, a plain string (text), or a dict `{"text": ...}` / `{"messages": [{"role", "content"}]}`.

    Raises:
        ValueError: The dict has neither key, or a message lacks role/content (names which one).
    """
    if isinstance(item, t.TextSample | t.ChatSample):
        return item
    if isinstance(item, str):
        return t.TextSample(item)
    if isinstance(item, dict):
        if "text" in item:
            if not isinstance(item["text"], str):
                raise ValueError("'text' must be a string")
            return t.TextSample(item["text"])
        if "messages" in item:
            msgs = item["messages"]
            if not isinstance(msgs, list):
                raise ValueError("'messages' must be a list of {role, content} objects")
            out = []
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
                try:
                    role = t.Role(str(m["role"]).lower())
                except ValueError:
                    raise ValueError(
                        f"messages[{i}].role={m['role']!r}: must be one of system, user, assistant"
                    ) from None
                out.append(t.ChatMessage(role, str(m["content"])))
            return t.ChatSample(tuple(out))
        raise ValueError("a sample object needs a 'text' or a 'messages' key")
    raise TypeError(f"cannot use a {type(item).__name__} as a sample; pass str, TextSample, ChatSample or dict")


def batches(samples: Iterable[t.Sample | str | dict[str, Any]]) -> Iterator[list[common_pb2.Sample]]:
    """Splits samples into AppendSamples-sized batches of protobuf samples."""
    batch: list[common_pb2.Sample] = []
    size = 0
    for item in samples:
        pb = conv.sample_to_pb(as_sample(item))
        n = pb.ByteSize()
        if batch and (len(batch) >= MAX_BATCH_SAMPLES or size + n > MAX_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(pb)
        size += n
    if batch:
        yield batch


def generate_request(
    prompt: str | Sequence[t.ChatMessage],
    *,
    adapter_id: str,
    raw: bool,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    stop: Sequence[str],
    base_model: str,
    system: str | None,
    extra_adapter_ids: Sequence[str] = (),
    repetition_penalty: float = 0.0,
) -> inference_pb2.GenerateRequest:
    """Builds a GenerateRequest: a string is one user turn (or raw text with raw=True), else the given turns."""
    req = inference_pb2.GenerateRequest(
        adapter_id=adapter_id,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=list(stop),
        base_model=base_model,
        extra_adapter_ids=list(extra_adapter_ids),
        repetition_penalty=repetition_penalty,
    )
    if isinstance(prompt, str) and raw:
        req.text = prompt
        return req
    turns = [t.ChatMessage(t.Role.USER, prompt)] if isinstance(prompt, str) else list(prompt)
    if system:
        turns.insert(0, t.ChatMessage(t.Role.SYSTEM, system))
    req.chat.CopyFrom(conv.chat_to_pb(turns))
    return req
