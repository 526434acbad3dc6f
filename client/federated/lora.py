"""LoRA math shared by the federated ServerApp and ClientApp (numpy only): seeded A, shapes, PEFT files, ΔW."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

# PEFT module name -> its HF block, in block order (as lorad.server.engine.models.config.TARGET_TO_HF; the SDK does
# not import the daemon).
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
PEFT_NAMES = tuple(TARGETS)
_PREFIX = "base_model.model."
MAX_TAR_BYTES = 256 * 1024 * 1024  # ImportAdapter's limit

Arrays = dict[str, NDArray[np.float32]]


class UpdateMismatchError(ValueError):
    """An update whose base model, rank, targets, seed or tensor shapes differ from the federation's."""


@dataclass(frozen=True)
class FedLora:
    """What every device's adapter must share in one federation (the server decides it, devices check it)."""

    base_model_sha256: str
    rank: int
    alpha: float
    targets: tuple[str, ...]  # PEFT module names, e.g. ("q_proj", "v_proj")
    seed: int  # FFA-LoRA: A of every module is drawn from this seed

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(sorted(self.targets)))  # order carries no meaning
        problems = []
        if len(self.base_model_sha256) != 64:
            problems.append(f"base_model_sha256={self.base_model_sha256[:80]!r}: must be 64 hex digits")
        if not 1 <= self.rank <= 128:
            problems.append(f"rank={self.rank}: must be 1 to 128")
        if not self.alpha > 0:
            problems.append(f"alpha={self.alpha}: must be > 0")
        bad = [t for t in self.targets if t not in PEFT_NAMES]
        if bad or not self.targets:
            problems.append(f"targets={list(self.targets)}: choose among {sorted(PEFT_NAMES)}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of B·A."""
        return self.alpha / self.rank


def module_shapes(model_config: Mapping[str, Any], targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every adapted projection of a Llama/Qwen model, by PEFT module name.

    Args:
        model_config: the model's HF config.json contents.
        targets: PEFT module names.
    """
    c = model_config
    hidden = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    inter = int(c["intermediate_size"])
    dims = {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv * head_dim, hidden),
        "v_proj": (kv * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    out: dict[str, tuple[int, int]] = {}
    for i in range(int(c["num_hidden_layers"])):
        for hf, block in TARGETS.items():
            if hf in targets:
                out[f"model.layers.{i}.{block}.{hf}"] = dims[hf]
    return out


def a_key(module: str) -> str:
    """PEFT tensor name of a module's A."""
    return f"{_PREFIX}{module}.lora_A.weight"


def b_key(module: str) -> str:
    """PEFT tensor name of a module's B."""
    return f"{_PREFIX}{module}.lora_B.weight"


def module_of(key: str) -> str:
    """The module name inside a PEFT tensor name."""
    return key.removeprefix(_PREFIX).removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")


def seeded_a(seed: int, module: str, rank: int, in_features: int) -> NDArray[np.float32]:
    """A of one module, drawn from (seed, module name): the same bytes on every machine (numpy PCG64).

    Uniform in ±1/sqrt(in_features), PEFT's default A scale (kaiming-uniform with a = sqrt(5)).
    """
    rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(module.encode())]))
    bound = 1.0 / np.sqrt(in_features)
    return rng.uniform(-bound, bound, size=(rank, in_features)).astype(np.float32)


def seeded_as(fed: FedLora, shapes: Mapping[str, tuple[int, int]]) -> Arrays:
    """Every module's seeded A, by PEFT tensor name."""
    return {a_key(m): seeded_a(fed.seed, m, fed.rank, fan_in) for m, (_, fan_in) in shapes.items()}


def zero_bs(fed: FedLora, shapes: Mapping[str, tuple[int, int]]) -> Arrays:
    """Every module's B at zero (a fresh adapter changes nothing), by PEFT tensor name."""
    return {b_key(m): np.zeros((fan_out, fed.rank), np.float32) for m, (fan_out, _) in shapes.items()}


def delta_w(tensors: Mapping[str, NDArray[np.float32]], scale: float) -> dict[str, NDArray[np.float64]]:
    """ΔW = scale·B·A of every module (float64), by module name."""
    out = {}
    for k, b in tensors.items():
        if k.endswith(".lora_B.weight"):
            m = module_of(k)
            out[m] = scale * (b.astype(np.float64) @ tensors[a_key(m)].astype(np.float64))
    return out


def check_update(
    fed: FedLora,
    meta: Mapping[str, object],
    arrays: Mapping[str, NDArray[np.float32]],
    expected: Mapping[str, tuple[int, ...]],
) -> None:
    """Refuses an update made for another base model, rank, targets or seed, or with other tensors.

    Raises:
        UpdateMismatchError: naming the first field that differs (values shortened, never sample content).
    """
    if meta.get("base_model_sha256") != fed.base_model_sha256:
        raise UpdateMismatchError(f"base_model_sha256 {str(meta.get('base_model_sha256'))[:16]}… differs")
    if meta.get("rank") != fed.rank:
        raise UpdateMismatchError(f"rank {meta.get('rank')!r} != {fed.rank}")
    targets = meta.get("targets")
    if not isinstance(targets, list) or sorted(str(t) for t in targets) != sorted(fed.targets):
        raise UpdateMismatchError(f"targets {targets!r} != {sorted(fed.targets)}")
    if meta.get("seed") != fed.seed:
        raise UpdateMismatchError(f"seed {meta.get('seed')!r} != {fed.seed}")
    if set(arrays) != set(expected):
        missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
        raise UpdateMismatchError(f"tensors differ: {len(missing)} missing, {len(extra)} unexpected")
    for k, shape in expected.items():
        a = arrays[k]
        if tuple(a.shape) != tuple(shape):
            raise UpdateMismatchError(f"{k}: shape {tuple(a.shape)} != {tuple(shape)}")
        if not np.all(np.isfinite(a)):
            raise UpdateMismatchError(f"{k}: non-finite values")


def peft_tar(fed: FedLora, tensors: Mapping[str, NDArray[np.float32]], base_name: str = "") -> bytes:
    """A PEFT adapter as an uncompressed tar (adapter_config.json + adapter_model.safetensors), as lorad serves it.

    The lorad_metadata.json inside records the base hash, so the daemon's ImportAdapter checks it.
    """
    from safetensors.numpy import save

    weights = save(
        {k: np.ascontiguousarray(v, np.float32) for k, v in sorted(tensors.items())},
        metadata={"format": "pt", "lorad_base_model_hash": fed.base_model_sha256},
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": fed.rank,
        "lora_alpha": fed.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(fed.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    files = {"adapter_config.json": json.dumps(config, indent=2).encode(), "adapter_model.safetensors": weights}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def read_peft_tar(blob: bytes) -> tuple[dict[str, object], Arrays]:
    """(adapter_config.json, tensors) of a PEFT tar as DownloadAdapter serves it.

    Raises:
        ValueError: not a PEFT tar.
    """
    from safetensors.numpy import load

    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        for need in ("adapter_config.json", "adapter_model.safetensors"):
            if need not in members:
                raise ValueError(f"{need} missing from the adapter tar")
        cfg_f = tar.extractfile(members["adapter_config.json"])
        w_f = tar.extractfile(members["adapter_model.safetensors"])
        assert cfg_f is not None and w_f is not None  # regular files
        config = json.loads(cfg_f.read())
        tensors = {k: np.asarray(v, np.float32) for k, v in load(w_f.read()).items()}
    return config, tensors


def sha256_hex(blob: bytes) -> str:
    """Lowercase hex SHA-256."""
    return hashlib.sha256(blob).hexdigest()
