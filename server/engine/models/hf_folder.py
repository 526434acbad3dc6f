"""Reads a Hugging Face checkpoint folder: config.json + *.safetensors (+ tokenizer files).

Imports torch only when a tensor is read: the config and the safetensors headers (a parameter count) need none.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from lorad.server.engine.models.config import ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import Tensor


def is_hf_folder(path: Path) -> bool:
    """True when `path` is a directory with config.json and at least one .safetensors file."""
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_config(path: Path) -> ModelConfig:
    """Parses `path/config.json` into a ModelConfig."""
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors shards in name order (adapter files excluded)."""
    return sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("adapter_"))


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype names -> torch dtypes; torch is imported on the first tensor read (a header read, as status's
    parameter count, needs no torch)."""
    import torch

    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }


class SafetensorsWeights(Mapping[str, "Tensor"]):
    """Tensors of safetensors shards, each read from disk on access (pread, no mmap).

    Every access returns a fresh tensor the caller owns, so building a model that converts/copies each weight
    peaks at one extra tensor instead of keeping the whole file mapped (and counted in RSS) during the build.
    """

    def __init__(self, files: list[Path]) -> None:
        self._index: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for f in files:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))  # header length, little-endian u64
                size = os.fstat(fh.fileno()).st_size
                if n > size - 8:  # a corrupt file would otherwise make us allocate n bytes (MemoryError)
                    raise ValueError(f"{f}: not a valid safetensors file (header of {n} bytes in a {size}-byte file)")
                header = json.loads(fh.read(n))
            for k, v in header.items():
                if k != "__metadata__":
                    s, e = v["data_offsets"]
                    self._index[k] = (f, v["dtype"], tuple(v["shape"]), 8 + n + s, 8 + n + e)

    def __getitem__(self, key: str) -> Tensor:
        import torch

        f, dtype, shape, start, end = self._index[key]
        if end == start:
            return torch.empty(shape, dtype=_dtypes()[dtype])
        buf = bytearray(end - start)
        fd = os.open(f, os.O_RDONLY)
        try:
            view, got = memoryview(buf), 0
            while got < len(buf):
                k = os.preadv(fd, [view[got:]], start + got)
                if k <= 0:
                    raise OSError(f"{f}: short read of {key!r} ({got}/{len(buf)} bytes)")
                got += k
        finally:
            os.close(fd)
        return torch.frombuffer(buf, dtype=_dtypes()[dtype]).reshape(shape)

    def stored_dtype(self, key: str) -> torch.dtype:
        """The dtype ``key`` is stored in (header only)."""
        return _dtypes()[self._index[key][1]]

    def parameter_count(self) -> int:
        """Elements of all stored tensors, from the headers alone (frozen weights included, nothing read)."""
        return sum(math.prod(shape) for _, _, shape, _, _ in self._index.values())

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def read_weights(path: Path) -> SafetensorsWeights:
    """All tensors of the folder's safetensors shards by HF name, as stored (dtype unchanged), read lazily.

    Raises:
        FileNotFoundError: The folder has no safetensors file.
    """
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}; save the model with safe_serialization=True")
    return SafetensorsWeights(files)
