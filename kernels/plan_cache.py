"""Plans in the product: an on-disk cache keyed by what decides a plan (a resume never replans), and applying one."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
from torch import Tensor, nn

from lorad.kernels._swap import frozen_sites, set_frozen
from lorad.kernels.frozen import make_frozen_linear
from lorad.kernels.plan import PLANNER_VERSION, PrecisionPlan
from lorad.kernels.planner import plan_precision

log = structlog.get_logger(__name__)


def plan_key(
    *,
    model_hash: str,
    backend: str,
    candidates: Sequence[str],
    budget: float,
    reference: str = "fp32",
    mode: str = "fast",
    cost: str = "bytes",
    layers: Mapping[str, tuple[int, int]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything that decides a plan, as a JSON-ready dict (its sha256 names the cache file).

    Args:
        model_hash: content hash of the base weights.
        backend: kernel backend the plan was measured on.
        candidates: candidate precisions (order does not matter).
        budget: error budget.
        reference: reference precision.
        mode: planner mode ("fast" or "exact").
        cost: cost model.
        layers: planned layer name -> (out, in); another target set is another plan.
        extra: caller-chosen fields that also decide the plan (e.g. LoRA rank/targets, calibration tokens).
    """
    return {
        "model_hash": model_hash,
        "backend": backend,
        "candidates": sorted(candidates),
        "budget": float(budget),
        "reference": reference,
        "mode": mode,
        "cost": cost,
        "planner_version": PLANNER_VERSION,
        "layers": hashlib.sha256(json.dumps(sorted((layers or {}).items())).encode()).hexdigest()[:16],
        "extra": dict(extra or {}),
    }


def cache_path(cache_dir: Path, key: Mapping[str, Any]) -> Path:
    """The cache file of ``key``: ``<cache_dir>/plan-<sha256[:20]>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"plan-{digest}.json"


def read_cached(path: Path, key: Mapping[str, Any]) -> PrecisionPlan | None:
    """The plan stored at ``path`` for ``key``; None (with a logged reason) when absent, corrupt or for another key."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") != json.loads(json.dumps(key)):
            raise ValueError("stored key differs from the requested key")
        return PrecisionPlan.from_dict(doc["plan"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("precision_plan_cache_ignored", path=str(path), reason=f"{type(e).__name__}: {e}"[:200])
        return None


def write_cached(path: Path, key: Mapping[str, Any], plan: PrecisionPlan) -> None:
    """Write ``{"key", "plan"}`` atomically (temp file in the same directory → fsync → rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = json.dumps({"key": dict(key), "plan": plan.to_dict()}, indent=1, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_plan(
    cache_dir: Path,
    model: nn.Module,
    loss_fn: Callable[[], Tensor],
    weights: Mapping[str, tuple[Tensor, Tensor | None]],
    *,
    model_hash: str,
    backend: str,
    candidates: Sequence[str] = ("w8a8",),
    budget: float = 0.05,
    reference: str = "fp32",
    mode: str = "fast",
    cost: str = "bytes",
    extra_key: Mapping[str, Any] | None = None,
    **plan_kwargs: Any,
) -> tuple[PrecisionPlan, bool]:
    """The cached plan for this (model, backend, candidates, budget, planner version, ...) or a new one.

    A missing, corrupt or mismatching cache file is ignored (the reason is logged) and the model is planned with
    ``plan_precision`` on ``loss_fn``'s calibration batch; the new plan is then written atomically.

    Args:
        cache_dir: directory for plan files (the caller's; created when missing).
        model: the model at the reference precision (see ``plan_precision``).
        loss_fn: calibration loss (only called when planning).
        weights: layer name -> (W, bias), as for ``plan_precision``.
        model_hash: content hash of the base weights (cache key).
        backend: kernel backend (cache key; also where the plan is measured).
        candidates: candidate precisions.
        budget: error budget (see ``plan_precision``).
        reference: reference precision.
        mode: planner mode.
        cost: cost model.
        extra_key: more fields for the key (e.g. LoRA rank/targets, calibration tokens).
        **plan_kwargs: passed to ``plan_precision`` (e.g. ``max_layer_error``, ``max_backoff``).

    Returns:
        (plan, from_cache).
    """
    shapes = {n: (int(w.shape[0]), int(w.shape[1])) for n, (w, _) in weights.items()}
    key = plan_key(model_hash=model_hash, backend=backend, candidates=candidates, budget=budget,
                   reference=reference, mode=mode, cost=cost, layers=shapes, extra=extra_key)  # fmt: skip
    path = cache_path(cache_dir, key)
    cached = read_cached(path, key)
    if cached is not None:
        log.info("precision_plan_cache_hit", path=str(path), **cached.summary())
        return cached, True
    plan = plan_precision(model, loss_fn, weights, backend=backend, reference=reference, candidates=candidates,
                          budget=budget, cost=cost, mode=mode, **plan_kwargs)  # fmt: skip
    write_cached(path, key, plan)
    log.info("precision_plan_cached", path=str(path))
    return plan, False


def apply_plan(
    model: nn.Module,
    plan: PrecisionPlan,
    weights: Mapping[str, tuple[Tensor, Tensor | None]],
    *,
    backend: str,
    cache_dir: Path | None = None,
    model_hash: str = "",
) -> int:
    """Re-lower ``model`` in place to ``plan``: each named layer whose precisions differ gets a new frozen linear.

    Every reference to the old object is swapped (a projection and its LoRALinear share one), so the LoRA
    parameters, optimizer state and RNG are untouched; no second model load is needed.

    Args:
        model: the model (as planned).
        plan: the plan to apply (layers it does not name run at its reference precision).
        weights: layer name -> (W, bias), as for ``plan_precision``.
        backend: kernel backend.
        cache_dir: backend cache (QNN EP contexts).
        model_hash: base model hash (backend cache keys).

    Returns:
        How many layers were rebuilt.
    """
    rebuilt = 0
    for n, (fl, sites) in frozen_sites(model, list(weights)).items():
        pf, pb = plan.precisions(n)
        if (fl.precision_fwd, fl.precision_bwd) == (pf, pb):
            continue
        w, b = weights[n]
        new = make_frozen_linear(w, b, backend=backend, precision=pf, precision_bwd=pb, name=fl.name or n,
                                 cache_dir=cache_dir, model_hash=model_hash)  # fmt: skip
        set_frozen(sites, new)
        rebuilt += 1
    log.info("precision_plan_applied", rebuilt=rebuilt, layers=len(weights), weight_bytes=plan.weight_bytes())
    return rebuilt
