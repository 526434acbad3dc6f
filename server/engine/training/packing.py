"""Packing tokenized samples into fixed-length sequences, the seeded epoch order and the resumable batch stream."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lorad.server.engine.training.data import TokenizedSample

IGNORE = -100  # label value the loss skips (Hugging Face convention)


@dataclass(frozen=True)
class PackedSeq:
    """One training sequence: `seq_len` input ids and labels aligned with them (IGNORE where no loss), of which the
    first `tokens` are the samples' own (the rest is padding)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    tokens: int


class Batch(NamedTuple):
    """Sequences stacked: input ids and labels [B, T] int64, and how many of the ids are the samples' own tokens
    (padding excluded: what progress counts as tokens trained)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    tokens: int


def pack(samples: list[TokenizedSample], seq_len: int, pad_id: int) -> list[PackedSeq]:
    """Packs samples in the given order into sequences of exactly `seq_len` tokens.

    A sample that fits in one sequence is never split: if it does not fit in the space left, the current sequence
    is padded and a new one started. Longer (text) samples fill the current sequence and continue into the next.
    Samples share a sequence without an attention mask between them (standard packing; the model interface takes no
    document ids), and labels are the input ids where the sample's mask is True; the model shifts them by one.

    Args:
        samples: tokenized samples in training order.
        seq_len: tokens per sequence.
        pad_id: id used for padding (its labels are IGNORE).

    Returns:
        The packed sequences.
    """
    out: list[PackedSeq] = []
    ids: list[int] = []
    labels: list[int] = []

    def flush() -> None:
        if ids:
            n = seq_len - len(ids)
            out.append(PackedSeq(tuple(ids + [pad_id] * n), tuple(labels + [IGNORE] * n), len(ids)))
            ids.clear()
            labels.clear()

    for s in samples:
        if len(s.ids) <= seq_len and len(ids) + len(s.ids) > seq_len:
            flush()
        for tok, keep in zip(s.ids, s.mask, strict=False):
            ids.append(tok)
            labels.append(tok if keep else IGNORE)
            if len(ids) == seq_len:
                flush()
    flush()
    return out


def target_count(labels: torch.Tensor) -> int:
    """Number of tokens the loss averages over: labels[:, 1:] that are not IGNORE (the model shifts by one)."""
    return int((labels[:, 1:] != IGNORE).sum())


# A trimmed micro-batch keeps a multiple of this many positions: whole 16-row blocks for the GEMM kernels and AMX
# tiles, and at most seq_len / 16 distinct shapes for the per-shape caches (oneDNN primitives, causal masks).
TRIM_MULTIPLE = 16


def trim_tail(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch without the trailing positions no loss reads: a packed sequence ends in padding (a sample that
    fits in one sequence is never split), and attention is causal, so positions after the last labelled one change
    nothing before them and get no gradient. Keeps the positions up to the batch's last label (it is predicted from
    the position before it), rounded up to TRIM_MULTIPLE and at most the batch's length. The loss and every gradient
    are those of the whole batch; only the GEMMs' summation order differs.

    Args:
        x: input ids [B, T].
        y: labels [B, T] aligned with ``x`` (IGNORE where no loss).

    Returns:
        ``(x, y)`` cut to their first ``n`` positions (views); unchanged when nothing is labelled.
    """
    labelled = (y != IGNORE).any(dim=0).nonzero()
    if labelled.numel() == 0:
        return x, y
    n = -(-(int(labelled[-1]) + 1) // TRIM_MULTIPLE) * TRIM_MULTIPLE
    return x[:, :n], y[:, :n]  # a slice stops at the batch's length


def to_batch(seqs: list[PackedSeq]) -> Batch:
    """Stacks sequences into a Batch (input_ids[B, T], labels[B, T] int64, their sample tokens)."""
    return Batch(
        torch.tensor([s.input_ids for s in seqs], dtype=torch.long),
        torch.tensor([s.labels for s in seqs], dtype=torch.long),
        sum(s.tokens for s in seqs),
    )


def epoch_order(samples: list[TokenizedSample], seed: int, epoch: int) -> list[TokenizedSample]:
    """The training order for one epoch: a shuffle seeded by (seed, epoch), independent of any global RNG."""
    order = list(samples)
    random.Random(f"lorad:{seed}:{epoch}").shuffle(order)
    return order


class BatchStream:
    """Endless micro-batches over shuffled, packed epochs; its cursor (epoch, index) makes resumption exact."""

    def __init__(
        self, samples: list[TokenizedSample], *, seq_len: int, batch_size: int, seed: int, pad_id: int
    ) -> None:
        """Creates a stream positioned at epoch 0, sequence 0.

        Raises:
            ValueError: `samples` is empty.
        """
        if not samples:
            raise ValueError("BatchStream needs at least one training sample")
        self._samples, self._seq_len, self._bs = samples, seq_len, batch_size
        self._seed, self._pad = seed, pad_id
        self.epoch, self.index = 0, 0
        self._seqs = self._pack_epoch(0)

    def _pack_epoch(self, epoch: int) -> list[PackedSeq]:
        return pack(epoch_order(self._samples, self._seed, epoch), self._seq_len, self._pad)

    @property
    def sequences_per_epoch(self) -> int:
        """Packed sequences in the current epoch."""
        return len(self._seqs)

    @property
    def cursor(self) -> dict[str, int]:
        """Position of the next sequence; store it in a checkpoint."""
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, cursor: dict[str, int]) -> None:
        """Moves to a cursor from `cursor`.

        Raises:
            ValueError: the cursor is outside its epoch.
        """
        epoch, index = int(cursor["epoch"]), int(cursor["index"])
        seqs = self._pack_epoch(epoch)
        if not 0 <= index < len(seqs):
            raise ValueError(f"data cursor index={index} outside epoch {epoch} with {len(seqs)} sequences")
        self.epoch, self.index, self._seqs = epoch, index, seqs

    def next_batch(self) -> Batch:
        """The next `batch_size` sequences, continuing into the next epoch as needed."""
        picked: list[PackedSeq] = []
        while len(picked) < self._bs:
            picked.append(self._seqs[self.index])
            self.index += 1
            if self.index == len(self._seqs):
                self.epoch, self.index = self.epoch + 1, 0
                self._seqs = self._pack_epoch(self.epoch)
        return to_batch(picked)


def eval_batches(
    samples: list[TokenizedSample], *, seq_len: int, batch_size: int, pad_id: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Held-out micro-batches (input_ids, labels) in hash order (independent of input order), at most `max_batches`."""
    seqs = pack(sorted(samples, key=lambda s: s.sample_hash), seq_len, pad_id)
    batches = [to_batch(seqs[i : i + batch_size])[:2] for i in range(0, len(seqs), batch_size)]
    return batches[:max_batches]
