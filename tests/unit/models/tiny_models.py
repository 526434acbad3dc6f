"""Tiny random checkpoints for tests: HF folders (Llama, Llama 3 rope, Qwen2 biases, Qwen3 q/k norm) and GGUFs."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320


def save_tiny_hf(tmp: Path, arch: str, seed: int = 0, tie: bool = True) -> Path:
    """Saves a 2-layer random transformers model of `arch` and returns its folder."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "llama3":
        cfg = tf.LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=1000000.0)
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=16, rope_theta=1000000.0)
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random init leaves norms at 1 and biases at 0; perturb them so the test can see mistakes there.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    out = tmp / arch
    model.save_pretrained(out)
    write_tokenizer_files(out)
    return out


CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! 1234 tokens, chat and code.",
    "user assistant system: what is the capital of France? Paris is.",
] * 20


def train_tiny_bpe(vocab_size: int = VOCAB) -> tuple[list[str], list[str]]:
    """A byte-level BPE with exactly `vocab_size` tokens (specials first); returns (tokens by id, merges)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    return tokens, merges


def write_tiny_gguf(hf_dir: Path, out: Path, quant_ffn: bool = True) -> Path:
    """Writes the HF checkpoint at `hf_dir` as a llama.cpp GGUF (Llama q/k permuted, FFN in Q8_0).

    When quant_ffn, the HF folder's FFN weights are replaced by their Q8_0 round trip first, so the HF model and
    the GGUF hold the same numbers.
    """
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = cfg["model_type"]
    sd = load_file(str(hf_dir / "model.safetensors"))
    q8 = gguf.GGMLQuantizationType.Q8_0
    if quant_ffn:
        for k in list(sd):
            if ".mlp." in k:
                q = gguf.quants.quantize(sd[k].numpy(), q8)
                sd[k] = torch.from_numpy(gguf.quants.dequantize(q, q8).copy())
        save_file(sd, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def permute(w: np.ndarray, n: int) -> np.ndarray:  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tokens, merges = train_tiny_bpe(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for k, t in sd.items():
        a = t.float().numpy()
        if k.startswith("model.layers."):
            _, _, i, *mid, kind = k.split(".")
            if arch == "llama" and mid[-1] in ("q_proj", "k_proj"):
                a = permute(a, heads if mid[-1] == "q_proj" else kv)
            name = f"blk.{i}.{names['.'.join(mid)]}.{kind}"
        else:
            name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[k]
        if ".ffn_" in name and quant_ffn and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_tokenizer_files(out: Path) -> None:
    """Writes tokenizer.json + tokenizer_config.json (tiny BPE, ChatML template) into an HF folder."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = train_tiny_bpe()
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": "<|im_start|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
