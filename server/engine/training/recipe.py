"""The LoRA training recipe, top to bottom: setup → train → save → cleanup."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from lorad.kernels.capabilities import capability
from lorad.kernels.detect import BackendInfo
from lorad.server.engine.training import checkpoint as ckpt
from lorad.server.engine.training.config import TrainConfig
from lorad.server.engine.training.data import DataReport, Sample, prepare
from lorad.server.engine.training.heartbeat import Heartbeat
from lorad.server.engine.training.precision import (
    PLAN_FILE,
    UNPLANNED_FILE,
    JobPlan,
    cached_plan,
    frozen_weights,
    known_plan,
    mark_unplanned,
    measure_plan,
    plan_job,
    plans_here,
    provisional,
    quiet_now,
    relower,
    unplanned_precision,
)
from lorad.server.engine.training.trainer import CheckpointCallback, PhaseCallback, Progress, Trainer

log = structlog.get_logger(__name__)


@dataclass
class RecipeResult:
    """Outcome of one recipe run (one RUNNING period of a job)."""

    status: str
    step: int
    backend: str
    backend_reason: str
    precision: str
    losses: list[float]
    eval_losses: list[tuple[int, float]]
    data_report: DataReport
    resumed_from: int | None = None
    adapter_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # (layer, forward, backward) per planned layer; ("*", p, p) for one precision everywhere.
    precision_plan: tuple[tuple[str, str, str], ...] = ()
    plan_summary: dict[str, Any] | None = None  # PrecisionPlan.summary() when precision "auto" planned
    plan_sha256: str | None = None  # of work_dir/precision_plan.json


def _no_phase(phase: str, fraction: float | None) -> None:
    """The default `on_phase`: nobody listens."""


def _no_notice(message: str) -> None:
    """The default `on_notice`: nobody listens."""


def seed_everything(seed: int) -> None:
    """Seeds python `random`, numpy and torch (adapter init and dropout draw from torch's CPU generator)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def resolve_backend(backend: str) -> BackendInfo:
    """The backend a run nobody decided for trains on (bench, tests; the daemon decides once and passes its answer):
    ``backend`` itself if this machine can load it, else the automatic choice, with the reason."""
    from lorad.kernels import detect_backend

    return detect_backend(backend)


def resolve_precision(precision: str, backend: str) -> str:
    """The precision a model is loaded at: `precision` itself, or for "auto" the backend's reference precision (the
    planner then lowers each layer as far as the measured LoRA-gradient drift and the measured cost allow)."""
    return capability(backend).reference if precision == "auto" else precision


def save_adapter_files(model: Any, out: Path, metadata: dict[str, Any]) -> Path:
    """Default adapter writer: PEFT-named `adapter_model.safetensors` plus `training_metadata.json`, each atomic.

    The daemon passes the adapter registry's writer instead (full PEFT config, GGUF export).
    """
    from safetensors.torch import save as st_save

    blob = st_save({k: v.contiguous() for k, v in model.lora_state_dict().items()})
    ckpt.atomic_write(out / "adapter_model.safetensors", lambda f: f.write(blob))
    meta = json.dumps(metadata, indent=2, sort_keys=True).encode()
    ckpt.atomic_write(out / "training_metadata.json", lambda f: f.write(meta))
    return out


def run_recipe(
    cfg: TrainConfig,
    samples: Sequence[Sample],
    *,
    work_dir: Path,
    cache_root: Path,
    model_source: str | Path | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    should_pause: Callable[[], bool] | None = None,
    load: Callable[..., Any] | None = None,
    save_adapter: Callable[[Any, Path, dict[str, Any]], Path] = save_adapter_files,
    on_phase: PhaseCallback | None = None,
    on_loaded: Callable[[Any], None] | None = None,
    on_checkpoint: CheckpointCallback | None = None,
    backend: BackendInfo | None = None,
    defer_planning: bool = False,
    on_notice: Callable[[str], None] | None = None,
) -> RecipeResult:
    """Trains a LoRA adapter on `samples`, resuming from the newest checkpoint in `work_dir` if there is one.

    Args:
        cfg: validated hyper-parameters.
        samples: the job's samples (a fixed data window; the checkpoint remembers its fingerprint).
        work_dir: the job's directory: `checkpoints/`, `precision_plan.json` (precision "auto") and `adapter/`.
        cache_root: model conversion + backend cache.
        model_source: HF folder, GGUF file, or None for the bundled SmolLM2-135M-Instruct.
        on_progress: called after every step.
        should_pause: polled at step boundaries; True → checkpoint and return status "paused".
        load: model loader with `lorad.server.engine.models.loader.load_model`'s signature (tests inject tiny models).
        save_adapter: writes the finished adapter; returns its directory.
        on_phase: told when the run enters a phase (see `PhaseCallback`); called on the training thread (planning's
            heartbeat also from a timer thread, one call at a time).
        on_checkpoint: told about each checkpoint written (see `CheckpointCallback`), so nobody polls the folder.
        on_loaded: called with the LoadedModel once it is built at its final precisions, before any checkpoint is
            restored (its adapter is the fresh one: B = 0, so it computes the base model's loss).
        backend: the backend decided by the caller (the daemon), used as given; None resolves ``cfg.backend`` here.
        defer_planning: precision "auto" on a model with no plan yet: train at once at the backend's unplanned
            precision (``Capability.unplanned``) and measure the plan after the adapter is saved, for the jobs after
            this one (the daemon: CreateJob never waits ~10 s for planning). False: plan first, then train on it.
        on_notice: told things the job's owner should read (e.g. that this job trains before its plan exists).

    Returns:
        The result; status "completed" (adapter saved) or "paused" (checkpoint saved).
    """
    # -- setup ---------------------------------------------------------------------------------------------------
    from lorad.server.engine.models.config import LoraConfig

    if backend is not None and cfg.backend not in ("auto", backend.name):
        raise ValueError(f"cfg.backend={cfg.backend!r} but the decided backend is {backend.name!r}")
    phase = on_phase or _no_phase
    notice = on_notice or _no_notice
    phase("loading", None)
    info = backend or resolve_backend(cfg.backend)
    precision = resolve_precision(cfg.precision, info.name)
    seed_everything(cfg.seed)
    lora = LoraConfig(rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout, targets=cfg.targets)
    ckpt_dir = ckpt.checkpoint_dir(work_dir)
    ckpt.remove_stale_temps(ckpt_dir)
    last = ckpt.latest(ckpt_dir)
    planning = plans_here(info.name, cfg.precision)
    plan_args: dict[str, Any] = {"backend": info.name, "work_dir": work_dir, "cache_root": cache_root}
    job_plan: JobPlan | None = None
    # An "auto" job resumes as it started wherever it resumes, even where "auto" would not plan (a home directory
    # moved to a CPU without bf16, another backend): its plan, or the uniform precision it started at before its model
    # had one, binds the resume (exact), and a record made on another backend is a clear error.
    resuming_auto = cfg.precision == "auto" and last is not None
    unplanned = unplanned_precision(work_dir, info.name) if resuming_auto else None
    if planning and last is None:
        (work_dir / UNPLANNED_FILE).unlink(missing_ok=True)  # a previous start's, without a checkpoint
    look_up = unplanned is None and (planning or (resuming_auto and (work_dir / PLAN_FILE).is_file()))
    with Heartbeat(lambda f: phase("loading", f)):  # a model load takes seconds: heard every ~1 s meanwhile
        if load is None:
            from lorad.server.engine.models.loader import load_model, resolve

            # A known plan (the job's own on resume, or the cache's) is built directly: no reference-precision copy.
            if look_up:
                job_plan = known_plan(resolve(model_source, cache_root).model_hash, cfg, resuming=last is not None,
                                      keep_provisional=defer_planning, **plan_args)  # fmt: skip
            if look_up and job_plan is None and defer_planning:
                unplanned = capability(info.name).unplanned()
            load_at: Any = job_plan.plan if job_plan else (unplanned or precision)
            loaded = load_model(model_source, cache_root=cache_root, backend=info.name, precision=load_at, lora=lora)
        else:  # an injected loader (tests): load at the reference, then re-lower to a known plan
            loaded = load(model_source, cache_root=cache_root, backend=info.name, precision=precision, lora=lora)
            if look_up:
                job_plan = known_plan(loaded.model_hash, cfg, resuming=last is not None,
                                      keep_provisional=defer_planning, **plan_args)  # fmt: skip
                if job_plan is not None:
                    relower(loaded, job_plan.plan, frozen_weights(loaded), backend=info.name, cache_root=cache_root)
                elif defer_planning:
                    unplanned = capability(info.name).unplanned()
            if unplanned is not None and unplanned != precision:
                loaded = load(model_source, cache_root=cache_root, backend=info.name, precision=unplanned, lora=lora)
    if unplanned is not None:
        precision = unplanned
        if last is None:
            mark_unplanned(work_dir, unplanned, info.name)
            told = (f"no precision plan for this model yet: this job trains at {unplanned} everywhere; the plan is "
                    "measured after it finishes and used by the jobs after it")  # fmt: skip
        else:
            told = f"this job resumes at {unplanned} everywhere, as it started (before its model had a precision plan)"
        notice(told)
    elif planning or job_plan is not None:
        if job_plan is None:
            # Before the Trainer: its optimizer and hooks must see the re-lowered model.
            with Heartbeat(lambda f: phase("planning", f)) as beat:
                job_plan = plan_job(loaded, cfg, on_progress=beat.set, **plan_args)
        precision = "auto"
    if on_loaded is not None:
        on_loaded(loaded)
    tok = loaded.tokenizer
    data = prepare(samples, tok, seq_len=cfg.seq_len, eval_fraction=cfg.eval_fraction)
    pad_id = tok.eos_id if tok.eos_id is not None else 0
    layers = job_plan.layers() if job_plan else (("*", precision, precision),)
    if cfg.freeze_lora_a:  # after planning (it measures dA too); the optimizer then only sees B
        for lin in loaded.model.lora_modules():
            lin.lora.lora_A.requires_grad_(False)
    trainer = Trainer(
        loaded.model,
        cfg,
        data,
        pad_id=pad_id,
        checkpoint_dir=ckpt_dir,
        on_progress=on_progress,
        should_pause=should_pause,
        on_phase=phase,
        on_checkpoint=on_checkpoint,
    )
    if last is not None:
        trainer.restore(last.path)
    log.info(
        "recipe_setup",
        backend=info.name,
        precision=precision,
        plan_sha256=job_plan.sha256[:16] if job_plan else None,
        resumed_from=last.step if last else None,
        train_samples=data.report.train_samples,
        eval_samples=data.report.eval_samples,
    )
    try:
        # -- train -----------------------------------------------------------------------------------------------
        res = trainer.run()
        # -- save ------------------------------------------------------------------------------------------------
        adapter_dir = None
        if res.status == "completed":
            phase("exporting", None)
            meta = {
                "base_model_hash": loaded.model_hash,
                "tokenizer_hash": loaded.tokenizer_hash,
                "config": cfg.to_dict(),
                "backend": info.name,
                "precision": precision,
                **({"precision_plan": job_plan.metadata()} if job_plan else {}),
                "steps": res.step,
                "data_fingerprint": data.fingerprint,
                "data_report": data.report.to_dict(),
                "final_loss": res.losses[-1] if res.losses else None,
                "eval_losses": [list(e) for e in res.eval_losses],
            }
            adapter_dir = save_adapter(loaded.model, work_dir / "adapter", meta)
    finally:
        # -- cleanup ---------------------------------------------------------------------------------------------
        trainer.close()
    extra: dict[str, Any] = {}
    if unplanned is not None:
        extra["unplanned"] = unplanned
    # A job that trained unplanned, or on a plan priced on a busy host, measures the plan for the jobs after it.
    stale = job_plan is not None and provisional(job_plan.plan)
    if planning and defer_planning and res.status == "completed" and (unplanned is not None or stale):
        # -- plan for the next jobs (the adapter is saved) ------------------------------------------------------
        model_hash = loaded.model_hash
        del trainer, loaded  # the training copy goes before the reference copy is loaded
        loader = load if load is not None else _engine_loader()
        extra["planned_after"] = _plan_after(
            lambda: loader(model_source, cache_root=cache_root, backend=info.name,
                           precision=capability(info.name).reference, lora=lora),
            cfg, backend=info.name, cache_root=cache_root, model_hash=model_hash, phase=phase,
            should_stop=should_pause or (lambda: False), notice=notice,
        )  # fmt: skip
    return RecipeResult(
        res.status,
        res.step,
        info.name,
        info.reason,
        precision,
        res.losses,
        res.eval_losses,
        data.report,
        last.step if last else None,
        adapter_dir,
        precision_plan=layers,
        plan_summary=job_plan.plan.summary() if job_plan else None,
        plan_sha256=job_plan.sha256 if job_plan else None,
        extra=extra,
    )


class _PlanningStoppedError(Exception):
    """The job was told to stop while its model's plan was being measured after training."""


def _engine_loader() -> Callable[..., Any]:
    from lorad.server.engine.models.loader import load_model

    return load_model


def _plan_after(
    load_reference: Callable[[], Any],
    cfg: TrainConfig,
    *,
    backend: str,
    cache_root: Path,
    model_hash: str,
    phase: PhaseCallback,
    should_stop: Callable[[], bool],
    notice: Callable[[str], None],
) -> bool:
    """Measures and caches the plan of a model a job just trained unplanned or on a provisional plan (re-measured
    only if the host is quiet now); True when a usable plan is cached.

    Runs as the job's "planning" phase after its adapter is saved. A stop request (pause, cancel, conditions, daemon
    stop) ends it at the next progress tick with nothing cached; so does a failure, which is logged and told: the
    adapter stands either way, and the next unplanned job measures again.
    """
    from lorad.server.engine.models.heap import release_free_heap

    cached = cached_plan(model_hash, cfg, backend=backend, cache_root=cache_root)
    if cached is not None and not provisional(cached):
        return True  # another job measured it meanwhile
    if cached is not None and not quiet_now(backend):
        return True  # still busy: the provisional plan serves on; a job that ends on a quiet host measures it
    try:
        with Heartbeat(lambda f: phase("planning", f)) as beat:
            beat.set(0.0)

            def tick(fraction: float) -> None:
                if should_stop():
                    raise _PlanningStoppedError
                beat.set(fraction)

            loaded = load_reference()
            tick(0.0)
            measure_plan(loaded, cfg, backend=backend, cache_root=cache_root, on_progress=tick)
    except _PlanningStoppedError:
        log.info("precision_plan_stopped", model_hash=model_hash)
        notice("precision planning stopped; the next job on this model measures the plan")
        return False
    except Exception as exc:  # the adapter is saved: planning for later jobs must not fail this one
        log.exception("precision_plan_failed", model_hash=model_hash)
        notice(f"precision planning failed ({type(exc).__name__}: {str(exc)[:200]}); the next job tries again")
        return False
    finally:
        release_free_heap()
    return True
