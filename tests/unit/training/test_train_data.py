"""Rendering, masks, rejections, hash split, packing and the resumable batch stream."""

import pytest
import torch

from lorad.server.engine.training.data import ChatSample, DataError, Message, TextSample, is_eval, prepare, sample_hash
from lorad.server.engine.training.packing import (
    IGNORE,
    TRIM_MULTIPLE,
    BatchStream,
    eval_batches,
    pack,
    target_count,
    trim_tail,
)
from tests.fixtures.tiny_lm import EOS, IM_END, CharTokenizer, corpus

TOK = CharTokenizer()


def test_text_and_chat_masks() -> None:
    chat = ChatSample((Message("system", "be kind"), Message("user", "hi"), Message("assistant", "yo")))
    d = prepare([TextSample("abc"), chat], TOK, seq_len=64, eval_fraction=0.0)
    text, conv = d.train
    assert text.ids == (*TOK.encode("abc"), EOS) and all(text.mask)
    trained = [i for i, m in zip(conv.ids, conv.mask) if m]
    assert trained == [*TOK.encode("yo"), IM_END]  # only the assistant turn (content + end marker)
    assert d.report.train_target_tokens == 4 + 3


def test_unusable_samples_reported_with_reasons() -> None:
    samples = [
        TextSample("   "),
        ChatSample(()),
        ChatSample((Message("user", "only a question"),)),
        ChatSample((Message("user", "q"), Message("robot", "a"))),
        ChatSample((Message("user", "q"), Message("assistant", "x" * 100))),  # > seq_len
        TextSample("y" * 500),  # > max_tokens
        "not a sample",
        TextSample("fine"),
    ]
    d = prepare(samples, TOK, seq_len=32, eval_fraction=0.0, max_tokens=200)  # type: ignore[arg-type]
    r = d.report
    assert dict(r.rejected) == {"empty": 2, "no_assistant_turn": 1, "bad_role": 1, "too_long": 2, "bad_sample_type": 1}
    assert [x.index for x in r.rejections] == [0, 1, 2, 3, 4, 5, 6]
    assert "robot" in r.rejections[3].detail
    assert r.train_samples == 1 and r.rejected_total == 7 and r.total == 8


def test_no_usable_data_raises_with_report() -> None:
    with pytest.raises(DataError) as ei:
        prepare([TextSample("")], TOK, seq_len=32, eval_fraction=0.0)
    assert ei.value.report.rejected["empty"] == 1


def test_split_is_by_hash_and_stable_under_append() -> None:
    base = corpus(200)
    d1 = prepare(base, TOK, seq_len=128, eval_fraction=0.2)
    assert d1.report.rejected_total == 0
    d2 = prepare(base + corpus(100, seed=7), TOK, seq_len=128, eval_fraction=0.2)
    ev1 = {s.sample_hash for s in d1.eval}
    ev2 = {s.sample_hash for s in d2.eval}
    assert ev1 and ev1 <= ev2
    assert not ev1 & {s.sample_hash for s in d2.train}
    assert 0.1 < len(d1.eval) / 200 < 0.3
    assert all(is_eval(sample_hash(s), 0.2) == (sample_hash(s) in ev1) for s in base)


def test_pack_lengths_labels_and_no_split_of_short_samples() -> None:
    d = prepare(corpus(40), TOK, seq_len=48, eval_fraction=0.0)
    seqs = pack(d.train, 48, pad_id=EOS)
    assert all(len(s.input_ids) == 48 == len(s.labels) for s in seqs)
    stream = [t for s in seqs for t, lab in zip(s.input_ids, s.labels)]
    assert len(stream) == 48 * len(seqs)
    # Every short sample appears contiguously inside one sequence.
    short = [smp for smp in d.train if len(smp.ids) <= 48]
    assert len(short) > 10
    for smp in short:
        assert any(_contains(s.input_ids, smp.ids) for s in seqs)
    # Labels equal ids where trained, IGNORE elsewhere; total trained tokens preserved.
    assert sum(lab != IGNORE for s in seqs for lab in s.labels) == d.report.train_target_tokens
    for s in seqs:
        assert all(lab in (IGNORE, t) for t, lab in zip(s.input_ids, s.labels))
    # Each sequence knows its samples' tokens: the padding after them is not counted, and an epoch holds them all.
    assert sum(s.tokens for s in seqs) == d.report.train_tokens < 48 * len(seqs)
    for s in seqs:
        assert set(s.input_ids[s.tokens :]) <= {EOS} and set(s.labels[s.tokens :]) <= {IGNORE}


def test_a_batch_counts_its_samples_tokens_not_padding() -> None:
    d = prepare([TextSample("ab"), TextSample("z" * 40)], TOK, seq_len=32, eval_fraction=0.0)
    stream = BatchStream(d.train, seed=0, seq_len=32, batch_size=2, pad_id=EOS)
    batches = [stream.next_batch() for _ in range(3)]  # an epoch packs into 2 sequences: three epochs
    assert all(b.input_ids.shape == (2, 32) for b in batches)
    assert batches[0].tokens == d.report.train_tokens == (2 + 1) + (40 + 1)  # one epoch is one batch here
    assert [b.tokens for b in batches[1:]] == [batches[0].tokens] * 2
    assert 0 < batches[0].tokens < 64  # the short sample's sequence is mostly padding


def test_long_text_spans_sequences() -> None:
    d = prepare([TextSample("z" * 70), TextSample("ab")], TOK, seq_len=32, eval_fraction=0.0)
    seqs = pack(d.train, 32, pad_id=EOS)
    assert len(seqs) == 3
    assert sum(lab != IGNORE for s in seqs for lab in s.labels) == 71 + 3


def _contains(hay: tuple[int, ...], needle: tuple[int, ...]) -> bool:
    n = len(needle)
    return any(hay[i : i + n] == needle for i in range(len(hay) - n + 1))


def test_stream_deterministic_by_seed_and_resumable() -> None:
    d = prepare(corpus(30), TOK, seq_len=32, eval_fraction=0.0)
    kw = {"seq_len": 32, "batch_size": 2, "pad_id": EOS}
    a, b, c = BatchStream(d.train, seed=1, **kw), BatchStream(d.train, seed=1, **kw), BatchStream(d.train, seed=2, **kw)
    xa = [a.next_batch()[0] for _ in range(40)]  # crosses several epochs
    assert a.epoch >= 2
    assert all(torch.equal(x, b.next_batch()[0]) for x in xa)
    assert not all(torch.equal(x, c.next_batch()[0]) for x in xa[:5])
    # Seek to a saved cursor in a fresh stream and continue identically.
    r = BatchStream(d.train, seed=1, **kw)
    for _ in range(7):
        r.next_batch()
    cur = r.cursor
    rest = [r.next_batch()[0] for _ in range(10)]
    fresh = BatchStream(d.train, seed=1, **kw)
    fresh.seek(cur)
    assert all(torch.equal(x, fresh.next_batch()[0]) for x in rest)
    with pytest.raises(ValueError, match="outside epoch"):
        fresh.seek({"epoch": 0, "index": 10_000})


def test_eval_batches_and_target_count() -> None:
    d = prepare(corpus(100), TOK, seq_len=32, eval_fraction=0.3)
    ev = eval_batches(d.eval, seq_len=32, batch_size=2, pad_id=EOS, max_batches=3)
    assert len(ev) == 3 and ev[0][0].shape == (2, 32)
    rev = eval_batches(list(reversed(d.eval)), seq_len=32, batch_size=2, pad_id=EOS, max_batches=3)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(ev, rev))
    labels = torch.tensor([[5, IGNORE, 7, 8]])
    assert target_count(labels) == 2  # position 0 is never a target after the shift


def test_tiny_data_set_always_holds_one_sample_out() -> None:
    # Three samples whose hashes all fall outside a 10 % split: the hash split alone would hold out nothing.
    samples = [s for s in (TextSample(f"tiny sample {i}") for i in range(40)) if not is_eval(sample_hash(s), 0.1)][:3]
    d = prepare(samples, TOK, seq_len=64, eval_fraction=0.1)
    assert d.report.eval_samples == 1 and d.report.train_samples == 2
    nearest = min(samples, key=lambda s: sample_hash(s)[:16])
    assert [s.sample_hash for s in d.eval] == [sample_hash(nearest)], "deterministic: the sample nearest the split"
    assert prepare(samples, TOK, seq_len=64, eval_fraction=0.0).report.eval_samples == 0, "0 means no held-out set"
    assert prepare(samples[:1], TOK, seq_len=64, eval_fraction=0.1).report.eval_samples == 0, "one sample trains"


def _labels(t: int, last: list[int]) -> torch.Tensor:
    """Labels [len(last), t]: row i labelled at positions 1..last[i] (none where last[i] < 1)."""
    y = torch.full((len(last), t), IGNORE)
    for i, n in enumerate(last):
        if n >= 1:
            y[i, 1 : n + 1] = 7
    return y


@pytest.mark.parametrize(
    ("t", "last", "kept"),
    [
        (64, [37, 20], 48),  # the batch's last label decides, rounded up to whole blocks
        (64, [47], 48),  # label at 47 is predicted from position 46: 48 positions, no more
        (64, [48], 64),  # one position past a block boundary keeps the next block
        (64, [63], 64),  # labelled to the end: nothing trails
        (40, [33], 40),  # rounding never goes past the batch
        (64, [0, 0], 64),  # nothing labelled: left alone (the trainer skips such a batch)
    ],
)
def test_trim_tail_keeps_every_position_a_loss_reads(t: int, last: list[int], kept: int) -> None:
    assert TRIM_MULTIPLE == 16
    y = _labels(t, last)
    x = torch.arange(y.numel()).view_as(y)
    xt, yt = trim_tail(x, y)
    assert xt.shape == yt.shape == (len(last), kept)
    assert torch.equal(xt, x[:, :kept]) and torch.equal(yt, y[:, :kept])
    assert target_count(yt) == target_count(y)
