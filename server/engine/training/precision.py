"""Precision "auto" for a job: plan per layer by gradient sensitivity once, persist the plan, reuse it on resume."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from lorad.server.engine.training import checkpoint as ckpt
from lorad.server.engine.training.config import TrainConfig

log = structlog.get_logger(__name__)

PLAN_FILE = "precision_plan.json"
UNPLANNED_FILE = "precision_unplanned.json"  # an "auto" job that started before its model had a plan
PLAN_CACHE = "plans"  # under the cache root: plan-<key>.json and costs-<machine>.json

# Calibration text for planning. Sensitivity belongs to the base model, backend and adapter shape, not to one
# night's notes, so the planner measures on this fixed text (with a fixed-seed adapter) and the plan is cached per
# (model hash, backend, menu, budget, targets, rank, alpha, sequence bucket) and reused by every job and dataset.
CALIBRATION_TEXT = (
    "Every morning before work I walk the dog along the river, then make coffee and read the news. On Tuesdays I "
    "meet my sister for lunch; she teaches biology at the high school and tells me about her students. Last week "
    "we talked about moving to a smaller flat closer to the station, because the commute takes almost an hour. "
    "My doctor said I should sleep more and drink less coffee after three o'clock. I am learning Spanish with an "
    "app and can now order food and ask for directions. Remember: the car needs new tyres before winter, the "
    "rent is due on the first, and Grandma's birthday is on the twelfth of March. "
)
Weights = dict[str, tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class JobPlan:
    """The plan a job trains with, as recorded in the adapter metadata and the recipe result."""

    plan: Any  # lorad.kernels.PrecisionPlan
    sha256: str  # of the bytes of work_dir/precision_plan.json
    reused: bool  # not planned for this job: the job's own plan on resume, or the plan cache's

    def layers(self) -> tuple[tuple[str, str, str], ...]:
        """(layer, forward precision, backward precision) for every planned layer."""
        return tuple((n, lp.precision_fwd, lp.precision_bwd) for n, lp in self.plan.layers.items())

    def metadata(self) -> dict[str, Any]:
        """JSON-ready record: sha256, summary and per-layer precisions."""
        return {"sha256": self.sha256, "summary": self.plan.summary(), "layers": [list(t) for t in self.layers()]}


def plans_here(backend: str, precision: str) -> bool:
    """True when `precision` is "auto" and `backend` offers a real precision besides its reference on this machine."""
    from lorad.kernels.capabilities import capability

    return precision == "auto" and bool(capability(backend).planner_menu())


def seq_bucket(seq_len: int) -> int:
    """The sequence bucket a plan is for: the next power of two >= seq_len (at least 64)."""
    b = 64
    while b < seq_len:
        b *= 2
    return b


def plan_cache_key(model_hash: str, backend: str, cfg: TrainConfig, *, legacy: bool = False) -> dict[str, Any]:
    """Everything that decides a job's plan; the data, the seed and the learning schedule do not.

    ``legacy`` names the targets as lorad did before it used HF names (``q`` … ``down``): the key of plans cached
    by older versions, read once and re-stored under the current key.
    """
    from lorad.kernels.capabilities import capability
    from lorad.kernels.plan_cache import plan_key
    from lorad.server.engine.models.config import LEGACY_TARGETS

    cap = capability(backend)
    short = {hf: s for s, hf in LEGACY_TARGETS.items()}
    targets = sorted(short[t] if legacy else t for t in cfg.targets)
    return plan_key(
        model_hash=model_hash, backend=backend, candidates=cap.planner_menu(), budget=cfg.precision_budget,
        reference=cap.reference, mode="fast", cost="measured",
        extra={"rank": cfg.rank, "alpha": cfg.alpha, "targets": targets, "bucket": seq_bucket(cfg.seq_len)},
    )  # fmt: skip


def _persist(work_dir: Path, plan: Any, *, reused: bool) -> JobPlan:
    blob = json.dumps(plan.to_dict(), indent=1, sort_keys=True).encode()
    ckpt.atomic_write(work_dir / PLAN_FILE, lambda f: f.write(blob))
    return JobPlan(plan, hashlib.sha256(blob).hexdigest(), reused=reused)


def known_plan(
    model_hash: str,
    cfg: TrainConfig,
    *,
    backend: str,
    work_dir: Path,
    cache_root: Path,
    resuming: bool,
    keep_provisional: bool = False,
) -> JobPlan | None:
    """The plan this job trains with when no planning is needed: the job's own on resume, else a cached one.

    A provisional cached plan (see ``provisional``) is returned while the host is busy; once it is quiet, only with
    ``keep_provisional`` (a deferred job trains on it and re-measures it afterwards), else None (plan now).

    Raises:
        CheckpointError: resuming without a readable plan file for this backend.
    """
    if resuming:
        return read_job_plan(work_dir, backend)
    plan = cached_plan(model_hash, cfg, backend=backend, cache_root=cache_root)
    if plan is not None and provisional(plan) and not keep_provisional and quiet_now(backend):
        log.info("precision_plan_replanned_quiet", priced_share=plan.calibration["costs_cpu_share"])
        return None
    return None if plan is None else _persist(work_dir, plan, reused=True)


def quiet_now(backend: str) -> bool:
    """Whether the host is quiet enough right now to time a cost table that is cached for good (~0.2 s probe)."""
    from lorad.kernels.costs import busy, cpu_share_now

    share = cpu_share_now(backend)
    log.info("precision_host_probe", share=share)
    return not busy(share)


def cached_plan(model_hash: str, cfg: TrainConfig, *, backend: str, cache_root: Path) -> Any:
    """The plan cached for this model and ``cfg``'s key (provisional ones included), or None."""
    from lorad.kernels.plan_cache import cache_path, read_cached, write_cached

    key = plan_cache_key(model_hash, backend, cfg)
    plan = read_cached(cache_path(cache_root / PLAN_CACHE, key), key)
    if plan is None:  # cached by a lorad that named targets q, k, …: the same plan, re-stored under today's key
        old = plan_cache_key(model_hash, backend, cfg, legacy=True)
        if (old_path := cache_path(cache_root / PLAN_CACHE, old)).is_file():
            plan = read_cached(old_path, old)
            if plan is not None:
                write_cached(cache_path(cache_root / PLAN_CACHE, key), key, plan)
    return plan


def provisional(plan: Any) -> bool:
    """Whether ``plan`` was priced with a cost table timed on a busy host (see ``lorad.kernels.costs.BUSY_SHARE``):
    cached and reused while the host stays busy, replaced by the first job that starts on a quiet one."""
    from lorad.kernels.costs import busy

    return busy(plan.calibration.get("costs_cpu_share", math.nan))


def frozen_weights(loaded: Any) -> Weights:
    """HF layer name -> (W fp32, bias) of every frozen linear of a loaded model, "lm_head" included (tied or not).

    Read from the model's checkpoint folder; the caller drops the mapping once the plan is applied (it is a full
    fp32 copy of the linears: 540 MB for SmolLM2-135M).
    """
    from lorad.server.engine.models.hf_folder import read_weights

    w = read_weights(Path(loaded.checkpoint.path))
    keys = set(w.keys())
    out: Weights = {}
    for k in sorted(keys):
        if k.startswith("model.layers.") and k.endswith(".weight"):
            t = w[k]
            if t.dim() == 2:
                n = k.removesuffix(".weight")
                out[n] = (t.float(), w[n + ".bias"].float() if n + ".bias" in keys else None)
    tied = bool(getattr(getattr(loaded, "config", None), "tie_embeddings", True)) or "lm_head.weight" not in keys
    out["lm_head"] = (w["model.embed_tokens.weight" if tied else "lm_head.weight"].float(), None)
    return out


def relower(loaded: Any, plan: Any, weights: Weights, *, backend: str, cache_root: Path) -> int:
    """Re-lowers a loaded model in place to ``plan`` (``apply_plan``) and stacks the bf16 weights of the layer groups
    again (the rebuilt layers hold their own; ``CausalLM.stack_frozen``). Returns how many layers were rebuilt."""
    from lorad.kernels import apply_plan

    rebuilt = apply_plan(loaded.model, plan, weights, backend=backend,
                         cache_dir=cache_root / "backend", model_hash=loaded.model_hash)  # fmt: skip
    loaded.model.stack_frozen()
    return rebuilt


def calibration_loss(model: Any, tokenizer: Any, seq_len: int) -> Any:
    """Loss closure on one sequence of CALIBRATION_TEXT tokens (repeated to fill the bucket), every token labelled."""
    ids = tokenizer.encode(CALIBRATION_TEXT)
    ids = (ids * (seq_len // max(len(ids), 1) + 1))[:seq_len]
    x = torch.tensor([ids], dtype=torch.long)
    return lambda: model(x, x)


def _seeded_adapter(model: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sets every LoRA A/B to fixed-seed values (B non-zero, so dA is measured too); returns the originals."""
    saved = []
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lin in model.lora_modules():
            a, b = lin.lora.lora_A, lin.lora.lora_B
            saved.append((a.detach().clone(), b.detach().clone()))
            a.copy_((torch.rand(a.shape, generator=g) * 2 - 1) / math.sqrt(a.shape[1]))
            b.copy_(torch.randn(b.shape, generator=g) * 1e-2)
    return saved


def _restore_adapter(model: Any, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for lin, (a, b) in zip(model.lora_modules(), saved, strict=True):
            lin.lora.lora_A.copy_(a)
            lin.lora.lora_B.copy_(b)


def read_job_plan(work_dir: Path, backend: str) -> JobPlan:
    """The plan a job was started with, for a resume.

    Raises:
        CheckpointError: the plan file is missing, unreadable, or was made for another backend.
    """
    from lorad.kernels import PrecisionPlan

    path = work_dir / PLAN_FILE
    if not path.is_file():
        raise ckpt.CheckpointError(
            f"{path} is missing: this job trains with precision 'auto' and has a checkpoint, so it must resume on the "
            "plan it started with; restore the file or restart the job from step 0"
        )
    blob = path.read_bytes()
    try:
        plan = PrecisionPlan.from_dict(json.loads(blob))
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise ckpt.CheckpointError(f"{path}: unreadable precision plan ({e})") from None
    if plan.backend != backend:
        raise ckpt.CheckpointError(
            f"{path}: plan was made for backend {plan.backend!r}, this run uses {backend!r}; resume on {plan.backend!r}"
        )
    return JobPlan(plan, hashlib.sha256(blob).hexdigest(), reused=True)


def measure_plan(
    loaded: Any,
    cfg: TrainConfig,
    *,
    backend: str,
    cache_root: Path,
    on_progress: Callable[[float], None] | None = None,
    weights: Weights | None = None,
) -> Any:
    """Measures the precision plan of ``loaded``'s model for ``cfg``'s key and caches it (the model is left as is).

    The model must be loaded at the backend's reference precision. Planning measures on CALIBRATION_TEXT with a
    fixed-seed adapter and restores the adapter afterwards. ``on_progress`` (fraction done, 0..1) may raise to stop
    planning: nothing is cached then. ``weights`` are ``frozen_weights(loaded)`` when the caller has them.

    Returns:
        The PrecisionPlan (``lorad.kernels.PrecisionPlan``).
    """
    from lorad.kernels import plan_precision
    from lorad.kernels.capabilities import capability
    from lorad.kernels.costs import measure
    from lorad.kernels.plan_cache import cache_path, write_cached

    progress = on_progress or (lambda _f: None)
    cap = capability(backend)
    menu = cap.planner_menu()
    weights = weights if weights is not None else frozen_weights(loaded)
    bucket = seq_bucket(cfg.seq_len)
    shapes = {(int(w.shape[0]), int(w.shape[1])) for w, _ in weights.values()}
    progress(0.0)
    costs = measure(backend, shapes, (cap.reference, *menu), rows=bucket, cache_dir=cache_root / PLAN_CACHE,
                    on_progress=lambda f: progress(0.1 * f))  # fmt: skip
    progress(0.1)
    saved = _seeded_adapter(loaded.model)
    try:
        plan = plan_precision(
            loaded.model, calibration_loss(loaded.model, loaded.tokenizer, bucket), weights, backend=backend,
            reference=cap.reference, candidates=menu, budget=cfg.precision_budget, cost="measured", mode="fast",
            costs=costs, on_progress=lambda f: progress(0.1 + 0.85 * f), one_copy=True,
        )  # fmt: skip
    finally:
        _restore_adapter(loaded.model, saved)
    plan.costs = dict(costs.ms)  # stored with the job and printed by the benchmark
    plan.calibration["costs_cpu_share"] = costs.cpu_share
    key = plan_cache_key(loaded.model_hash, backend, cfg)
    if costs.busy:
        log.warning("precision_plan_provisional", reason="cost table timed on a busy host",
                    cpu_share=round(costs.cpu_share, 2))  # fmt: skip
    write_cached(cache_path(cache_root / PLAN_CACHE, key), key, plan)  # provisional ones too: see known_plan
    progress(1.0)
    log.info("precision_plan_measured", **plan.summary())
    return plan


def plan_job(
    loaded: Any,
    cfg: TrainConfig,
    *,
    backend: str,
    work_dir: Path,
    cache_root: Path,
    on_progress: Callable[[float], None] | None = None,
) -> JobPlan:
    """Plans a job's precisions before it trains (``measure_plan``), persists the plan, re-lowers the model to it.

    Call before the Trainer exists (its optimizer must see the final model). The model must be loaded at the
    backend's reference precision; planning leaves the job's adapter and the torch RNG as they were, so the training
    run is unchanged by it.

    Args:
        loaded: the model loaded at the backend's reference precision, with `checkpoint.path`.
        cfg: the job's config (budget, LoRA shape, sequence length).
        backend: the daemon's backend.
        work_dir: the job directory; the plan is persisted as `work_dir/precision_plan.json`.
        cache_root: lorad cache: plans and cost tables under `plans/`, backend artifacts under `backend/`.
        on_progress: called with the fraction of planning done (0..1).
    """
    from lorad.server.engine.models.heap import release_free_heap

    weights = frozen_weights(loaded)
    plan = measure_plan(loaded, cfg, backend=backend, cache_root=cache_root, on_progress=on_progress, weights=weights)
    job = _persist(work_dir, plan, reused=False)
    rebuilt = relower(loaded, plan, weights, backend=backend, cache_root=cache_root)
    release_free_heap()  # the reference copies and captured activations planning went through
    log.info("job_precision_planned", rebuilt=rebuilt, sha256=job.sha256[:16])
    return job


def unplanned_precision(work_dir: Path, backend: str) -> str | None:
    """The uniform precision an "auto" job started at because its model had no plan yet (``mark_unplanned``), or
    None. A resumed job keeps it even once the plan exists, so the resume is exact.

    Raises:
        CheckpointError: the record is unreadable or was made on another backend (like ``read_job_plan``).
    """
    path = work_dir / UNPLANNED_FILE
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_bytes())
        precision, made_on = str(rec["precision"]), str(rec["backend"])
    except (ValueError, KeyError, TypeError) as e:
        raise ckpt.CheckpointError(f"{path}: unreadable ({e}); restart the job from step 0") from None
    if made_on != backend:
        raise ckpt.CheckpointError(
            f"{path}: this job started at {precision} on backend {made_on!r}, this run uses {backend!r}; "
            f"resume on {made_on!r}"
        )
    return precision


def mark_unplanned(work_dir: Path, precision: str, backend: str) -> None:
    """Records that this job trains at ``precision`` everywhere until it ends (see ``unplanned_precision``)."""
    blob = json.dumps({"precision": precision, "backend": backend}).encode()
    ckpt.atomic_write(work_dir / UNPLANNED_FILE, lambda f: f.write(blob))
