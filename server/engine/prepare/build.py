"""Build a QNN context bundle on a host: every frozen linear x direction x token bucket, for one target SoC."""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor

from lorad.server.engine.models.config import TARGET_TO_HF, ModelConfig
from lorad.server.engine.prepare.manifest import (
    CONTEXTS,
    GraphEntry,
    Manifest,
    ResolvedPlan,
    model_hash_of_folder,
    sha256_file,
    write_manifest,
)
from lorad.server.engine.prepare.socs import SocTarget

log = structlog.get_logger(__name__)

DIRECTIONS = ("fwd", "bwd")


@dataclass(frozen=True)
class LinearSpec:
    """One frozen linear of the model, named exactly as lorad.server.engine.models.build_model names it."""

    name: str
    weight: Tensor  # [out, in]
    bias: Tensor | None


def frozen_linears(cfg: ModelConfig, weights: Mapping[str, Tensor]) -> Iterator[LinearSpec]:
    """The model's frozen linears in build_model's order and naming (layers' q,k,v,o,gate,up,down, then lm_head).

    Raises:
        KeyError: a weight the architecture needs is missing (named in the message).
    """

    def get(key: str) -> Tensor:
        if key not in weights:
            raise KeyError(f"weight {key!r} missing from the checkpoint (arch={cfg.arch})")
        return weights[key]

    for i in range(cfg.num_layers):
        for sub, proj in TARGET_TO_HF.values():
            name = f"model.layers.{i}.{sub}.{proj}"
            has_bias = cfg.attn_bias and proj in ("q_proj", "k_proj", "v_proj")
            yield LinearSpec(name, get(name + ".weight"), get(name + ".bias") if has_bias else None)
    tied = cfg.tie_embeddings or "lm_head.weight" not in weights
    yield LinearSpec("lm_head", get("model.embed_tokens.weight" if tied else "lm_head.weight"), None)


def resolve_plan(names: list[str], default: str, plan_file: Path | None) -> ResolvedPlan:
    """Per-layer (fwd, bwd) precisions from a plan file, with ``default`` for layers the file does not name.

    The file is either a lorad.kernels PrecisionPlan (``PrecisionPlan.to_dict()`` JSON) or
    ``{layer: {"fwd": p, "bwd": p}}``.

    Raises:
        ValueError: a precision the qnn-htp backend does not support (every bad layer is listed).
    """
    from lorad.kernels.qnn_htp import SUPPORTED

    chosen: dict[str, tuple[str, str]] = {n: (default, default) for n in names}
    if plan_file is not None:
        raw: dict[str, Any] = json.loads(plan_file.read_text())
        if "version" in raw and isinstance(raw.get("layers"), list):
            from lorad.kernels.planner import PrecisionPlan

            plan = PrecisionPlan.from_dict(raw)
            chosen.update({n: plan.precisions(n) for n in names if n in plan.layers})
        else:
            chosen.update({n: p for n, p in ResolvedPlan.from_dict(raw).layers.items() if n in chosen})
    bad = [f"{n}: {p}" for n, p in chosen.items() if p[0] not in SUPPORTED or p[1] not in SUPPORTED]
    if bad:
        raise ValueError(f"precisions not supported on qnn-htp (choose from {SUPPORTED}): " + "; ".join(bad[:10]))
    return ResolvedPlan(chosen)


@contextlib.contextmanager
def targeting(target: SocTarget) -> Iterator[None]:
    """Make lorad.kernels build and key QNN graphs for ``target`` (its documented env override), then restore.

    Process-wide: `lorad prepare` is a CLI process; do not use it while other threads build QNN sessions.
    """
    keys = {"LORAD_QNN_SOC_MODEL": target.soc_model, "LORAD_QNN_HTP_ARCH": target.htp_arch}
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def context_path(lin: Any, direction: str, bucket: int) -> Path:
    """Where lorad.kernels keeps the EP-context file of one graph of ``lin``.

    Uses the kernels' cache-key function (QnnFrozenLinear._key); a public ``context_path`` hook is preferred
    when the kernels provide one.
    """
    fn = getattr(lin, "context_path", None) or lin._key
    path = fn(direction, bucket)
    if path is None:
        raise RuntimeError(f"{lin.name}: the qnn-htp backend keeps no EP-context file for {direction} T={bucket}")
    return Path(path)


def fresh_session_pool() -> None:
    """Drop the kernels' in-process pool of weight-free QNN sessions.

    The pool is keyed by graph bytes only, so a pooled session may come from another cache directory or another
    SoC target; after this, every distinct graph is built (or loaded) again for the current target and cache.
    """
    from lorad.kernels import qnn_htp

    clear = getattr(qnn_htp, "clear_session_pool", None)
    if clear is not None:
        clear()


def versions() -> dict[str, str]:
    """Versions that a context binary depends on (the kernels' cache key includes onnxruntime's)."""
    import onnxruntime as ort

    import lorad

    return {
        "lorad_version": lorad.__version__,
        "onnxruntime_version": ort.__version__,
        "onnxruntime_qnn_version": importlib.metadata.version("onnxruntime-qnn"),
    }


def build_bundle(
    model_dir: Path,
    target: SocTarget,
    out: Path,
    *,
    precision: str = "fp16",
    plan_file: Path | None = None,
    buckets: tuple[int, ...] = (256,),
    force: bool = False,
) -> Manifest:
    """Build every EP-context graph the model needs on ``target`` into the bundle directory ``out``.

    Written to a temp directory next to ``out`` and renamed at the end, so ``out`` is either complete or absent.

    Args:
        model_dir: Hugging Face model folder (config.json + safetensors).
        target: SoC the graphs are compiled for.
        out: bundle directory to create.
        precision: precision of layers the plan does not name (and of all layers without a plan).
        plan_file: optional precision plan JSON (see resolve_plan).
        buckets: static token buckets; the daemon must run with the same ones.
        force: replace an existing ``out``.

    Returns:
        The manifest written to ``out/manifest.json``.

    Raises:
        FileExistsError: ``out`` exists and ``force`` is False.
        ValueError: bad plan or buckets.
        RuntimeError: the qnn-htp backend cannot load here, or a graph failed to build.
    """
    from lorad.kernels import make_frozen_linear
    from lorad.kernels.qnn_htp import htp_unavailable_reason
    from lorad.server.engine.models.hf_folder import read_config, read_weights

    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    if not buckets or min(buckets) <= 0:
        raise ValueError(f"buckets must be positive token counts, got {buckets}")
    reason = htp_unavailable_reason()
    if reason:
        raise RuntimeError(f"cannot build QNN contexts on this host: {reason}")
    t0 = time.perf_counter()
    model_hash = model_hash_of_folder(model_dir)
    cfg = read_config(model_dir)
    weights = read_weights(model_dir)
    specs = list(frozen_linears(cfg, weights))
    plan = resolve_plan([s.name for s in specs], precision, plan_file)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / CONTEXTS).mkdir(parents=True)
    graphs: list[GraphEntry] = []
    try:
        with targeting(target):
            for spec in specs:
                # Empty the pool per layer: a pooled session (keyed by graph bytes) would skip writing this layer's
                # context file, e.g. o_proj's bwd graph equals q_proj's but is keyed by another shape label. With
                # the pool empty, every key the daemon will look up gets its file (repeated shapes load in ms).
                fresh_session_pool()
                fwd, bwd = plan.for_layer(spec.name)
                lin: Any = make_frozen_linear(
                    spec.weight.to(torch.float32), None if spec.bias is None else spec.bias.to(torch.float32),
                    backend="qnn-htp", precision=fwd, precision_bwd=bwd, name=spec.name, cache_dir=tmp / CONTEXTS,
                    model_hash=model_hash, buckets=buckets,
                )  # fmt: skip
                lin.warmup()
                for direction in DIRECTIONS:
                    for t in sorted(set(buckets)):
                        p = context_path(lin, direction, t)
                        prec = fwd if direction == "fwd" else bwd
                        rel = str(p.relative_to(tmp))
                        graphs.append(GraphEntry(spec.name, direction, t, prec, rel, p.stat().st_size, sha256_file(p)))
                del lin  # drop its sessions and host copy before the next layer (peak memory ~ one layer)
        v = versions()
        manifest = Manifest(
            model_hash=model_hash, model_name=model_dir.resolve().name, model_arch=cfg.arch,
            soc_chip=target.chip, soc_name=target.name, soc_model=target.soc_model, htp_arch=target.htp_arch,
            buckets=tuple(sorted(set(buckets))), plan=plan, graphs=tuple(graphs),
            created_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), host=platform.machine(),
            lorad_version=v["lorad_version"], onnxruntime_version=v["onnxruntime_version"],
            onnxruntime_qnn_version=v["onnxruntime_qnn_version"],
        )  # fmt: skip
        write_manifest(tmp, manifest)
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "bundle_built", out=str(out), soc=target.chip, graphs=len(graphs), model_hash=model_hash[:12],
        bytes=sum({g.file: g.bytes for g in graphs}.values()), seconds=round(time.perf_counter() - t0, 2),
    )  # fmt: skip
    return manifest
