"""Generation: KV cache equals full recompute, sampling is seeded, stop/max tokens, adapter swap without reload."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from lorad.server.engine.models.config import LoraConfig
from lorad.server.engine.models.generate import SamplingConfig, generate, generate_ids, penalize_repeats
from lorad.server.engine.models.loader import load_model
from lorad.server.engine.models.model import OWN, AdapterWeights
from tests.fixtures.tiny_hf import save_tiny_hf, write_tiny_gguf


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gen")
    hf = save_tiny_hf(root, "qwen2", seed=3)
    gguf = write_tiny_gguf(hf, root / "tiny.gguf")
    loaded = load_model(gguf, cache_root=root / "cache", lora=LoraConfig(rank=4, alpha=8))
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.normal_(0, 0.2)
    return loaded


def test_kv_cache_greedy_equals_no_cache(lm) -> None:
    prompt = lm.tokenizer.encode("The quick brown fox")
    cfg = SamplingConfig(max_new_tokens=20)
    with_cache = list(generate_ids(lm.model, prompt, cfg, adapter=OWN))
    without = list(generate_ids(lm.model, prompt, cfg, adapter=OWN, use_cache=False))
    assert with_cache == without and len(with_cache) == 20


def test_kv_cache_logits_match_full_forward(lm) -> None:
    from lorad.server.engine.models.kv_cache import KVCache

    ids = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = lm.model.logits(ids)
        cache = KVCache(lm.config, 16)
        a = lm.model.logits(ids[:, :5], cache=cache)  # prefix, then a multi-token chunk, then single tokens
        b = lm.model.logits(ids[:, 5:9], cache=cache)
        c = torch.cat([lm.model.logits(ids[:, i : i + 1], cache=cache) for i in range(9, 12)], dim=1)
    assert torch.allclose(torch.cat([a, b, c], dim=1), full, atol=1e-5)


def test_sampling_seeded_and_top_p(lm) -> None:
    prompt = lm.tokenizer.encode("Hello world")
    cfg = SamplingConfig(max_new_tokens=15, temperature=1.0, top_p=0.9, seed=7)
    a = list(generate_ids(lm.model, prompt, cfg))
    assert a == list(generate_ids(lm.model, prompt, cfg))
    b = list(generate_ids(lm.model, prompt, SamplingConfig(max_new_tokens=15, temperature=1.0, seed=8)))
    assert a != b
    # top_p tiny -> always the most likely token, i.e. greedy.
    tiny = SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=1e-6, seed=1)
    assert list(generate_ids(lm.model, prompt, tiny)) == list(generate_ids(lm.model, prompt, SamplingConfig(10)))


def test_stop_and_length_and_text(lm) -> None:
    prompt = lm.tokenizer.encode("Paris is")
    first = next(iter(generate_ids(lm.model, prompt, SamplingConfig(max_new_tokens=5))))
    toks = list(generate(lm.model, lm.tokenizer, prompt, SamplingConfig(max_new_tokens=5, stop_ids=(first,))))
    assert len(toks) == 1 and toks[0].finish_reason == "stop" and toks[0].text == ""
    toks = list(generate(lm.model, lm.tokenizer, prompt, SamplingConfig(max_new_tokens=6)))
    ids = [t.id for t in toks if t.finish_reason != "stop"]
    assert toks[-1].finish_reason in ("length", "stop")
    assert "".join(t.text for t in toks) == lm.tokenizer.decode(ids)


def test_adapter_swap_without_reload(lm) -> None:
    prompt = lm.tokenizer.encode("chat and code")
    cfg = SamplingConfig(max_new_tokens=12)
    own = lm.model.own_adapter()
    assert own is not None
    with torch.no_grad():
        base_logits = lm.model.logits(torch.tensor([prompt]), adapter=None)
        own_logits = lm.model.logits(torch.tensor([prompt]), adapter=own)
        live = lm.model.logits(torch.tensor([prompt]))
    assert torch.allclose(own_logits, live, atol=1e-5)
    assert not torch.allclose(base_logits, own_logits, atol=1e-3)
    zero = AdapterWeights({k: (a, torch.zeros_like(b)) for k, (a, b) in own.tensors.items()}, own.scale)
    assert list(generate_ids(lm.model, prompt, cfg, adapter=zero)) == list(generate_ids(lm.model, prompt, cfg))


def test_bad_sampling_config_lists_all_errors() -> None:
    with pytest.raises(ValueError, match=r"max_new_tokens=0.*temperature=-1.*top_p=0.*repetition_penalty=0"):
        SamplingConfig(max_new_tokens=0, temperature=-1, top_p=0, repetition_penalty=0)


def test_repetition_penalty_compounds_per_occurrence() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    out = penalize_repeats(logits, [0, 1, 0], 2.0)
    # token 0 twice: 2 / 2**2; token 1 once and negative: -1 * 2; the others untouched
    assert out.tolist() == [0.5, -2.0, 0.5, 3.0]
    assert penalize_repeats(logits, [0, 1], 1.0) is logits and penalize_repeats(logits, [], 2.0) is logits


def _longest_run(ids: list[int]) -> int:
    best = run = 1
    for a, b in itertools.pairwise(ids):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


def test_greedy_decoding_does_not_loop_on_one_token_with_a_penalty(lm) -> None:
    # The random tiny model is a worst case: greedy decoding without a penalty repeats one token forever.
    prompt = lm.tokenizer.encode("Hello world")
    plain = list(generate_ids(lm.model, prompt, SamplingConfig(max_new_tokens=40)))
    assert len(set(plain)) == 1, "precondition: the unpenalized model loops"
    penalized = list(generate_ids(lm.model, prompt, SamplingConfig(max_new_tokens=40, repetition_penalty=1.1)))
    assert _longest_run(penalized) <= 10 and len(set(penalized)) >= 4, penalized
    # The penalty looks at generated tokens only: the first token (nothing generated yet) is unchanged.
    assert penalized[0] == plain[0]


@pytest.mark.slow
def test_real_smollm2_convert_load_generate(tmp_path: Path) -> None:
    import time

    from lorad.server.engine.models.sources import default_model_path

    t0 = time.perf_counter()
    first = load_model(default_model_path(), cache_root=tmp_path)
    convert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lm2 = load_model(None, cache_root=tmp_path)
    cached_s = time.perf_counter() - t0
    assert lm2.model_hash == first.model_hash
    ids, _ = lm2.tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}], True)
    text = "".join(t.text for t in generate(lm2.model, lm2.tokenizer, ids, SamplingConfig(max_new_tokens=24)))
    print(f"convert {convert_s:.1f}s cached load {cached_s:.2f}s: {text!r}")
    assert "Paris" in text
    assert cached_s < convert_s
