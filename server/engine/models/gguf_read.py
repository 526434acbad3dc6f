"""Reads a llama.cpp GGUF model: config, dequantized HF-named weights, tokenizer and chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from torch import Tensor

from lorad.server.engine.models.config import ModelConfig

log = structlog.get_logger(__name__)

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp pre-tokenizer regexes (llama-vocab.cpp) as `tokenizers` pre-tokenizer sequences.
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


@dataclass
class GGUFModel:
    """Everything lorad needs from a GGUF file, in Hugging Face form."""

    config: ModelConfig
    weights: dict[str, Tensor]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str) -> str:
    """Maps a GGUF tensor name (`blk.3.attn_q.weight`) to its HF name (`model.layers.3.self_attn.q_proj.weight`).

    Raises:
        KeyError: The tensor has no Llama/Qwen counterpart.
    """
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


def gguf_name(hf: str) -> str:
    """Maps an HF tensor name (`model.layers.3.self_attn.q_proj.weight`) to llama.cpp's (`blk.3.attn_q.weight`).

    Raises:
        KeyError: The tensor has no GGUF counterpart.
    """
    inv_block = {v: k for k, v in _BLOCK_NAMES.items()}
    inv_top = {v: k for k, v in _TOP_NAMES.items()}
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        mod, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{inv_block[mod]}.{kind}"
    mod, kind = hf.rsplit(".", 1)
    return f"{inv_top[mod]}.{kind}"


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Llama q/k row permutation (convert_hf_to_gguf `permute`), the inverse of `unpermute_qk`."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Llama q/k row permutation (convert_hf_to_gguf `permute`) for [out, ...] weights/biases.

    llama.cpp interleaves the two rotary halves of each head; HF keeps them split: rows (head, half, i) were
    written as (head, i, half).
    """
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _config(reader: GGUFReader, n_vocab: int, has_output: bool) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported; use a llama, qwen2 or qwen3 GGUF")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    return ModelConfig(
        arch=arch,
        vocab_size=int(_field(reader, f"{arch}.vocab_size", n_vocab)),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_embeddings=not has_output,
        attn_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _tensor(t: Any) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne[0] (the input dim) first
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.array(t.data, dtype=np.float32).reshape(shape)  # a copy: t.data maps the file read-only
    return dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """A `tokenizers` byte-level BPE built from tokenizer.ggml.* metadata (GPT-2 style vocabularies).

    Raises:
        ValueError: The vocabulary is not BPE, or its pre-tokenizer is unknown.
    """
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model={kind!r} is not supported; only byte-level BPE ('gpt2')")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        tok.pre_tokenizer = byte_level
    elif pre in ("smollm", "starcoder", "refact", "codeshell"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("qwen2", "llama-bpe", "llama3"):
        regex = _QWEN2_RE if pre == "qwen2" else _LLAMA3_RE
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(pattern=_regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported; known: smollm, gpt2, qwen2, llama-bpe")
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_special_tokens(special)
    return tok


def _regex(pattern: str) -> Any:
    from tokenizers import Regex

    return Regex(pattern)


def _tokenizer_config(reader: GGUFReader, tokens: list[str]) -> dict[str, Any]:
    def tok_at(key: str) -> str | None:
        i = _field(reader, key)
        return None if i is None or i >= len(tokens) else tokens[int(i)]

    return {
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token": tok_at("tokenizer.ggml.bos_token_id"),
        "eos_token": tok_at("tokenizer.ggml.eos_token_id"),
        "pad_token": tok_at("tokenizer.ggml.padding_token_id"),
        "unk_token": tok_at("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def read_gguf(path: Path) -> GGUFModel:
    """Parses and dequantizes a GGUF model file into HF-named float32 weights.

    Args:
        path: A llama.cpp model GGUF (general.type = model).

    Returns:
        Config, weights, tokenizer.json text and tokenizer_config dict.

    Raises:
        ValueError: Unsupported architecture, tokenizer or rope scaling.
    """
    reader = GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path.name}: GGUF rope_freqs (llama3 rope scaling) is not supported; load the HF folder")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    cfg = _config(reader, len(tokens), "output.weight" in names)
    weights: dict[str, Tensor] = {}
    for t in reader.tensors:
        arr = _tensor(t)
        name = hf_name(t.name)
        if cfg.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            arr = unpermute_qk(arr, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(arr))
    tok = build_tokenizer(reader)
    log.info("gguf_read", arch=cfg.arch, tensors=len(weights), vocab=len(tokens))
    return GGUFModel(cfg, weights, tok.to_str(), _tokenizer_config(reader, tokens))


def hf_config_json(cfg: ModelConfig) -> str:
    """config.json text for a converted model."""
    return json.dumps(cfg.to_hf(), indent=2)
