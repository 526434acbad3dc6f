"""GGUF reading: a tiny GGUF written with the gguf package loads back to the same model, tokenizer and template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from lorad.server.engine.models.cache import read_manifest
from lorad.server.engine.models.gguf_read import read_gguf
from lorad.server.engine.models.loader import load_model, resolve
from tests.fixtures.tiny_hf import CORPUS, save_tiny_hf, write_tiny_gguf


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gguf_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    hf = save_tiny_hf(root, request.param, seed=5)
    return hf, write_tiny_gguf(hf, root / "tiny.gguf")


def test_gguf_weights_equal_hf(gguf_pair: tuple[Path, Path]) -> None:
    hf, path = gguf_pair
    from safetensors.torch import load_file

    ref = load_file(str(hf / "model.safetensors"))
    g = read_gguf(path)
    assert set(g.weights) == set(ref)
    for k, v in ref.items():
        assert torch.equal(g.weights[k], v.float()), k  # F32 exact; FFN holds the same Q8_0 values on both sides
    assert g.config.tie_embeddings and g.config.attn_bias == (g.config.arch == "qwen2")


def test_gguf_model_logits_match_transformers(gguf_pair: tuple[Path, Path], tmp_path: Path) -> None:
    import transformers as tf

    hf, path = gguf_pair
    lm = load_model(path, cache_root=tmp_path)
    ids = torch.randint(0, 320, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(ids).logits
        got = lm.model.logits(ids)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


def test_gguf_tokenizer_matches_trained_bpe(gguf_pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, path = gguf_pair
    tok = load_model(path, cache_root=tmp_path).tokenizer
    text = CORPUS[1] + " <|im_end|>"
    ids = tok.encode(text)
    assert ids[-1] == 2 and tok.decode(ids) == CORPUS[1] + " "
    assert tok.decode(ids, skip_special=False) == text
    assert 2 in tok.stop_ids and tok.eos_id == 2
    ids, mask = tok.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Paris is."}])
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special=False)
    assert trained == "Paris is.<|im_end|>"


def test_cache_conversion_reused(gguf_pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, path = gguf_pair
    first = resolve(path, tmp_path)
    m = read_manifest(first.path)
    assert m is not None and m["model_hash"] == first.model_hash
    assert json.loads((first.path / "config.json").read_text())["vocab_size"] == 320
    Tokenizer.from_file(str(first.path / "tokenizer.json"))
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    again = resolve(path, tmp_path)
    assert again == first and (again.path / "model.safetensors").stat().st_mtime_ns == stamp


def test_concurrent_first_use_converts_once(
    gguf_pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status read and a job resolving the same new GGUF together: one conversion, and both get the same folder."""
    import threading
    import time

    from lorad.server.engine.models import loader

    _, path = gguf_pair
    parses: list[float] = []

    def slow_read(p: Path) -> object:
        parses.append(time.monotonic())
        time.sleep(0.5)  # wide enough that the second caller arrives while the first converts
        return read_gguf(p)

    monkeypatch.setattr(loader, "read_gguf", slow_read)
    got: list[object] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            got.append(resolve(path, tmp_path))
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(got) == 3
    assert len(parses) == 1, f"{len(parses)} conversions of one GGUF"
    assert got[0] == got[1] == got[2]
    assert not [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".")], "a leftover temp folder"
