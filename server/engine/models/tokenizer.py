"""Tokenizer wrapper: encode/decode, chat-template rendering with an assistant-token mask, stop ids."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# End-of-turn markers of common chat templates; used as extra stop tokens when the vocabulary has them.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>")


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class ChatTokenizer:
    """A `tokenizers.Tokenizer` plus the model's chat template (Jinja, rendered like transformers does)."""

    def __init__(self, tok: Tokenizer, tok_config: dict[str, Any], extra_eos_ids: list[int] | None = None) -> None:
        """Wraps a tokenizer.

        Args:
            tok: The fast tokenizer (tokenizer.json).
            tok_config: tokenizer_config.json contents (chat_template, bos/eos tokens, add_bos_token).
            extra_eos_ids: More stop ids (config.json / generation_config.json eos_token_id).
        """
        self.tok = tok
        self.config = tok_config
        self.chat_template: str | None = tok_config.get("chat_template")
        self.bos_token = _token_str(tok_config.get("bos_token"))
        self.eos_token = _token_str(tok_config.get("eos_token"))
        self.add_bos = bool(tok_config.get("add_bos_token", False))
        self.bos_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        stops = {i for i in [self.eos_id, *(extra_eos_ids or [])] if i is not None}
        stops.update(i for t in _END_OF_TURN if (i := tok.token_to_id(t)) is not None)
        self.stop_ids: frozenset[int] = frozenset(stops)
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)

    @classmethod
    def from_dir(cls, path: Path) -> ChatTokenizer:
        """Loads tokenizer.json + tokenizer_config.json (+ chat_template.jinja, config.json eos ids) from a folder.

        Raises:
            FileNotFoundError: tokenizer.json is missing.
        """
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{tj} missing; lorad needs a fast tokenizer (tokenizer.json)")
        cfg_path = path / "tokenizer_config.json"
        tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        jinja = path / "chat_template.jinja"
        if not tok_cfg.get("chat_template") and jinja.is_file():
            tok_cfg["chat_template"] = jinja.read_text()
        extra: list[int] = []
        for name in ("config.json", "generation_config.json"):
            p = path / name
            if p.is_file():
                eos = json.loads(p.read_text()).get("eos_token_id")
                extra += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
        return cls(Tokenizer.from_file(str(tj)), tok_cfg, extra)

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary including added tokens."""
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def content_hash(self) -> str:
        """sha256 of the tokenizer definition and the chat template (identifies the tokenizer in adapters)."""
        h = hashlib.sha256(self.tok.to_str().encode())
        h.update(b"\0" + (self.chat_template or "").encode())
        return h.hexdigest()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of plain text (special-token strings in `text` map to their ids)."""
        ids: list[int] = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of token ids."""
        return str(self.tok.decode(ids, skip_special_tokens=skip_special))

    def apply_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """Renders messages with the chat template.

        Raises:
            ValueError: The tokenizer has no chat template.
        """
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template; use text samples or a chat model")
        return str(
            self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        )

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[bool]]:
        """Token ids of a chat and a mask that is True on assistant tokens (content + end-of-turn token).

        The whole conversation is tokenized at once (ids identical to inference), and the mask comes from the
        character spans each assistant message adds to the rendered text (found by rendering growing prefixes).

        Args:
            messages: [{"role": "system"|"user"|"assistant", "content": str}, ...].
            add_generation_prompt: Append the assistant header (inference prompts).

        Returns:
            (ids, assistant_mask) of equal length.

        Raises:
            ValueError: A message lacks role/content, or the template does not render prefixes incrementally.
        """
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} needs string 'role' and 'content' keys, got keys {sorted(m)}")
        spans: list[tuple[int, int]] = []
        prev = ""
        for i, m in enumerate(messages):
            cur = self.apply_template(messages[: i + 1])
            if not cur.startswith(prev):
                raise ValueError(
                    "chat template re-renders earlier turns; assistant masks need a prefix-stable template"
                )
            if m["role"] == "assistant":
                delta = cur[len(prev) :]
                end = len(prev) + len(delta.rstrip())  # the newline after the end-of-turn token is not trained
                at = delta.find(m["content"]) if m["content"] else -1
                # Empty/unfound content: train only the last char's token (the end-of-turn token).
                start = len(prev) + at if at >= 0 else end - 1
                spans.append((start, end))
            prev = cur
        text = self.apply_template(messages, add_generation_prompt) if add_generation_prompt else prev
        enc = self.tok.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        mask = [any(s < e_tok and b_tok < e for s, e in spans) for b_tok, e_tok in enc.offsets]
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids, mask = [self.bos_id, *ids], [False, *mask]
        return ids, mask


def _raise(msg: str) -> None:
    raise ValueError(f"chat template error: {msg}")
