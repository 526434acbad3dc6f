"""Precision "auto" for a job: plan per layer by gradient sensitivity once, persist the plan, reuse it on resume."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from lorad.server.engine.training import checkpoint as ckpt
from lorad.server.engine.training.config import TrainConfig
from lorad.server.engine.training.data import PreparedData
from lorad.server.engine.training.packing import BatchStream

log = structlog.get_logger(__name__)

PLAN_FILE = "precision_plan.json"
# Backend -> (reference precision the model is loaded and measured at, candidate precisions the planner may pick).
# torch is the reference backend: "auto" stays fp32 there (no planning). ort-cpu runs fp32 and w8a8; HTP runs
# fp16 natively and its QDQ graphs take w8a16/w8a8 (w4a16 is left out: not validated for training yet).
AUTO_PLAN: dict[str, tuple[str, tuple[str, ...]]] = {
    "ort-cpu": ("fp32", ("w8a8",)),
    "qnn-htp": ("fp16", ("w8a16", "w8a8")),
}

Weights = dict[str, tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class JobPlan:
    """The plan a job trains with, as recorded in the adapter metadata and the recipe result."""

    plan: Any  # lorad.kernels.PrecisionPlan
    sha256: str  # of the bytes of work_dir/precision_plan.json
    reused: bool  # read from work_dir on resume (never replanned)

    def layers(self) -> tuple[tuple[str, str, str], ...]:
        """(layer, forward precision, backward precision) for every planned layer."""
        return tuple((n, lp.precision_fwd, lp.precision_bwd) for n, lp in self.plan.layers.items())

    def metadata(self) -> dict[str, Any]:
        """JSON-ready record: sha256, summary and per-layer precisions."""
        return {"sha256": self.sha256, "summary": self.plan.summary(), "layers": [list(t) for t in self.layers()]}


def plans_here(backend: str, precision: str) -> bool:
    """True when `precision` is "auto" and `backend` has a planner setup (not the torch reference backend)."""
    return precision == "auto" and backend in AUTO_PLAN


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


def calibration_loss(model: Any, cfg: TrainConfig, data: PreparedData, pad_id: int) -> Any:
    """Loss closure on the first training micro-batch, drawn from a separate stream (the trainer's cursor stays)."""
    x, y = BatchStream(
        data.train, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed, pad_id=pad_id
    ).next_batch()
    return lambda: model(x, y)


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


def plan_job(
    loaded: Any,
    cfg: TrainConfig,
    data: PreparedData,
    *,
    pad_id: int,
    backend: str,
    work_dir: Path,
    cache_root: Path,
    resuming: bool,
) -> JobPlan:
    """Plans (or, on resume, re-reads) the job's precision plan and re-lowers `loaded.model` to it in place.

    Call before the Trainer exists: the optimizer must see the final model; the planner restores the torch RNG,
    and the calibration batch comes from its own stream, so the training run is unchanged by planning.

    Args:
        loaded: the model loaded at the backend's reference precision (AUTO_PLAN), with `checkpoint.path`.
        cfg: the job's config (budget, LoRA shape, data shape).
        data: the prepared data (first training batch = calibration batch).
        pad_id: padding token id.
        backend: the detected backend (a key of AUTO_PLAN).
        work_dir: the job directory; the plan is persisted as `work_dir/precision_plan.json`.
        cache_root: lorad cache; plans are cached under `plans/`, backend artifacts under `backend/`.
        resuming: a checkpoint exists; the persisted plan is reused and never replanned.

    Raises:
        CheckpointError: resuming without a readable plan file for this backend.
    """
    from lorad.kernels import apply_plan, load_or_plan

    reference, candidates = AUTO_PLAN[backend]
    weights = frozen_weights(loaded)
    if resuming:
        job = read_job_plan(work_dir, backend)
        from_cache = True
    else:
        plan, from_cache = load_or_plan(
            cache_root / "plans", loaded.model, calibration_loss(loaded.model, cfg, data, pad_id), weights,
            model_hash=loaded.model_hash, backend=backend, candidates=candidates, reference=reference,
            budget=cfg.precision_budget, mode="fast",
            extra_key={"rank": cfg.rank, "alpha": cfg.alpha, "targets": sorted(cfg.targets), "seed": cfg.seed,
                       "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "data": data.fingerprint},
        )  # fmt: skip
        blob = json.dumps(plan.to_dict(), indent=1, sort_keys=True).encode()
        ckpt.atomic_write(work_dir / PLAN_FILE, lambda f: f.write(blob))
        job = JobPlan(plan, hashlib.sha256(blob).hexdigest(), reused=False)
    rebuilt = apply_plan(loaded.model, job.plan, weights, backend=backend,
                         cache_dir=cache_root / "backend", model_hash=loaded.model_hash)  # fmt: skip
    log.info("job_precision_plan", reused=job.reused, from_cache=from_cache, rebuilt=rebuilt, sha256=job.sha256[:16],
             **job.plan.summary())  # fmt: skip
    return job
