"""The QNN context bundle manifest: what was built, for which model, plan and SoC, and each file's sha256."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CONTEXTS = "contexts"
FORMAT = "lorad-qnn-bundle"
FORMAT_VERSION = 1
_CHUNK = 8 * 2**20  # bytes per read while hashing: large files stream, memory stays flat


class BundleError(RuntimeError):
    """A bundle is unreadable, incomplete or corrupt."""


class BundleMismatchError(BundleError):
    """A bundle was prepared for another base model or another SoC than the one it is loaded for."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def model_hash_of_folder(folder: Path) -> str:
    """Content hash of a Hugging Face model folder: config.json and every weight shard, by name and bytes.

    Tokenizer files are excluded (they do not change the frozen weights the contexts are built from).

    Raises:
        FileNotFoundError: no config.json or no *.safetensors in ``folder``.
    """
    cfg = folder / "config.json"
    shards = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("adapter_"))
    if not cfg.is_file() or not shards:
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (config.json + *.safetensors)")
    h = hashlib.sha256()
    for p in (cfg, *shards):
        h.update(p.name.encode() + b"\0" + sha256_file(p).encode() + b"\n")
    return h.hexdigest()


@dataclass(frozen=True)
class ResolvedPlan:
    """Per-layer (forward, backward) precisions the bundle was built with; ``for_layer`` feeds build_model."""

    layers: Mapping[str, tuple[str, str]]

    def for_layer(self, name: str) -> tuple[str, str]:
        """(forward, backward) precision of layer ``name``.

        Raises:
            KeyError: the layer is not in the plan (names the layer).
        """
        if name not in self.layers:
            raise KeyError(f"layer {name!r} is not in the bundle's precision plan")
        return self.layers[name]

    def precisions(self, name: str) -> tuple[str, str]:
        """Same as for_layer (the lorad.kernels.PrecisionPlan spelling)."""
        return self.for_layer(name)

    def to_dict(self) -> dict[str, dict[str, str]]:
        """``{layer: {"fwd": p, "bwd": p}}``."""
        return {k: {"fwd": f, "bwd": b} for k, (f, b) in self.layers.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResolvedPlan:
        """Inverse of to_dict; also accepts ``{layer: [fwd, bwd]}``."""
        out: dict[str, tuple[str, str]] = {}
        for k, v in d.items():
            if isinstance(v, Mapping):
                out[k] = (str(v["fwd"]), str(v.get("bwd", v["fwd"])))
            else:
                out[k] = (str(v[0]), str(v[1]))
        return cls(out)


@dataclass(frozen=True)
class GraphEntry:
    """One EP-context graph file of the bundle."""

    layer: str
    direction: str  # "fwd" (x·Wᵀ + b) or "bwd" (dy·W)
    bucket: int  # static token count of the graph
    precision: str
    file: str  # path relative to the bundle root
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Everything a daemon needs to decide whether a bundle fits its model and SoC, and to check its files."""

    model_hash: str
    model_name: str
    model_arch: str
    soc_chip: str
    soc_name: str
    soc_model: str
    htp_arch: str
    buckets: tuple[int, ...]
    plan: ResolvedPlan
    graphs: tuple[GraphEntry, ...]
    lorad_version: str
    onnxruntime_version: str
    onnxruntime_qnn_version: str
    created_at: str
    host: str
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """Serialise with sorted keys (stable diffs)."""
        d = asdict(self)
        d["plan"] = self.plan.to_dict()
        d["buckets"] = list(self.buckets)
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest, checking the format tag and version.

        Raises:
            BundleError: not a lorad bundle manifest, or a format version this lorad cannot read.
        """
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise BundleError(f"not a lorad QNN bundle manifest (format={d.get('format')!r})")
            if d.get("format_version") != FORMAT_VERSION:
                raise BundleError(
                    f"bundle format version {d.get('format_version')} is not supported by this lorad (reads "
                    f"version {FORMAT_VERSION}); re-run `lorad prepare` with this lorad version"
                )
            d["plan"] = ResolvedPlan.from_dict(d["plan"])
            d["buckets"] = tuple(int(b) for b in d["buckets"])
            d["graphs"] = tuple(GraphEntry(**g) for g in d["graphs"])
            return cls(**d)
        except BundleError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise BundleError(f"malformed bundle manifest: {type(exc).__name__}: {exc}") from exc


def write_manifest(root: Path, manifest: Manifest) -> Path:
    """Write ``root/manifest.json`` atomically (temp file, fsync, rename)."""
    path = root / MANIFEST
    tmp = root / f".{MANIFEST}.{os.getpid()}.tmp"
    with tmp.open("w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def read_manifest(root: Path) -> Manifest:
    """Read ``root/manifest.json``.

    Raises:
        BundleError: missing or malformed.
    """
    path = root / MANIFEST
    if not path.is_file():
        raise BundleError(f"{root} is not a lorad QNN bundle: {MANIFEST} is missing")
    return Manifest.from_json(path.read_text())


def verify_files(root: Path, graphs: Iterable[GraphEntry], *, full: bool = True) -> None:
    """Check that every graph file exists with its recorded size (and sha256 when ``full``).

    Raises:
        BundleError: lists every missing, resized or altered file.
    """
    problems = []
    for g in graphs:
        p = root / g.file
        if not p.is_file():
            problems.append(f"missing {g.file}")
        elif p.stat().st_size != g.bytes:
            problems.append(f"{g.file} has {p.stat().st_size} bytes, manifest says {g.bytes}")
        elif full and sha256_file(p) != g.sha256:
            problems.append(f"{g.file} sha256 differs from the manifest")
    if problems:
        raise BundleError(f"bundle {root} is corrupt ({len(problems)} problems): " + "; ".join(problems[:10]))
