"""One federated round on a device: the local daemon trains from the global adapter; only the update leaves."""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import lorad.client as lc
from lorad.client.federated.lora import (
    Arrays,
    FedLora,
    a_key,
    module_of,
    peft_tar,
    read_peft_tar,
    seeded_a,
)

GATE_POLL_S = 1.0  # how often a waiting job's state is read
ROUND_REQUEST = re.compile(r"fed-\d+-\d+")  # request ids of round jobs: fed-<run id>-<round>


@dataclass(frozen=True)
class NodeSettings:
    """The SuperNode's node config (set by the device owner with `lorad federate join`; never sent anywhere)."""

    target: str  # the local daemon, e.g. "unix:/…/lorad.sock" or "127.0.0.1:7070"
    token_file: Path  # the app's token (a file, so it never appears in a process list)
    datasets: tuple[str, ...]
    opt_in: bool  # the owner's explicit yes for this app to take part
    base_model: str = ""
    gate_wait_s: float = 0.0  # how long a job may wait for charger/battery/thermal before the device declines
    job_timeout_s: float = 1800.0

    @classmethod
    def from_node_config(cls, c: Mapping[str, Any]) -> NodeSettings:
        """Parses Flower's node config (keys as `lorad federate join` writes them).

        Raises:
            ValueError: a required key is missing (named).
        """
        missing = [k for k in ("lorad-target", "lorad-token-file", "datasets") if not c.get(k)]
        if missing:
            raise ValueError(f"node config lacks {missing}; start the SuperNode with `lorad federate join`")
        return cls(
            target=str(c["lorad-target"]),
            token_file=Path(str(c["lorad-token-file"])),
            datasets=tuple(d for d in str(c["datasets"]).split(",") if d),
            opt_in=bool(c.get("opt-in", False)),
            base_model=str(c.get("base-model", "")),
            gate_wait_s=float(c.get("gate-wait-seconds", 0.0)),
            job_timeout_s=float(c.get("job-timeout-seconds", 1800.0)),
        )


@dataclass(frozen=True)
class RoundPlan:
    """What the server asks of this round (from the train message's config)."""

    fed: FedLora
    mode: str
    server_round: int
    in_features: tuple[int, ...]  # per module, in sorted B-key order (FFA regenerates A from the seed)
    steps: int
    learning_rate: float
    seq_len: int
    batch_size: int
    run_id: int

    @classmethod
    def from_config(cls, c: Mapping[str, Any], run_id: int) -> RoundPlan:
        """Parses the ConfigRecord the strategy sends."""
        fed = FedLora(
            base_model_sha256=str(c["base_model_sha256"]),
            rank=int(c["rank"]),
            alpha=float(c["alpha"]),
            targets=tuple(str(t) for t in c["targets"]),
            seed=int(c["seed"]),
        )
        return cls(
            fed=fed,
            mode=str(c["mode"]),
            server_round=int(c.get("server-round", 0)),
            in_features=tuple(int(i) for i in c.get("in_features", ())),
            steps=int(c.get("local-steps", 10)),
            learning_rate=float(c.get("learning-rate", 1e-3)),
            seq_len=int(c.get("seq-len", 256)),
            batch_size=int(c.get("batch-size", 1)),
            run_id=run_id,
        )


@dataclass(frozen=True)
class RoundResult:
    """A device's answer: an update with counts and metrics, or a decline with a reason code."""

    declined: str = ""  # reason code; empty when there is an update
    update: Arrays | None = None
    num_examples: int = 0
    metrics: Mapping[str, float] | None = None


def global_tensors(plan: RoundPlan, arrays: Arrays) -> Arrays:
    """The full global adapter: FFA adds the seeded As back to the received Bs; naive receives both."""
    if plan.mode == "naive":
        return dict(arrays)
    bs = sorted(k for k in arrays if k.endswith(".lora_B.weight"))
    if len(plan.in_features) != len(bs):
        raise ValueError(f"in_features has {len(plan.in_features)} entries for {len(bs)} B tensors")
    out = dict(arrays)
    for k, fan_in in zip(bs, plan.in_features, strict=True):
        m = module_of(k)
        out[a_key(m)] = seeded_a(plan.fed.seed, m, plan.fed.rank, fan_in)
    return out


def _decline_reason(exc: Exception) -> str:
    if isinstance(exc, lc.FailedPrecondition):
        return "base_mismatch"
    if isinstance(exc, lc.LoradError):
        return f"daemon_{type(exc).__name__}"
    return f"error_{type(exc).__name__}"


def run_round(node: NodeSettings, plan: RoundPlan, arrays: Arrays) -> RoundResult:
    """Runs one round against the local daemon; never raises (anything unexpected becomes a decline code)."""
    if not node.opt_in:
        return RoundResult(declined="not_opted_in")
    try:
        token = node.token_file.read_text().strip()
        with lc.Client(node.target, token, timeout=120) as c:
            return _train(c, node, plan, arrays)
    except Exception as exc:  # a decline, never a crash: the round goes on without this device
        return RoundResult(declined=_decline_reason(exc))


def round_request_id(plan: RoundPlan) -> str:
    """The request id of this round's job (CreateJob is idempotent on it: a retried round finds its job)."""
    return f"fed-{plan.run_id}-{plan.server_round}"


def reap_orphans(c: lc.Client, keep_request: str) -> int:
    """Cancels the round jobs that earlier rounds left unfinished and deletes those rounds' adapters (the imported
    global one and the trained one); returns how many jobs it cancelled.

    A round cleans up after itself when it ends; a SuperNode killed mid-round never got there, and its job would
    train on for nobody while its adapters held the app's quota. `lorad federate join` runs one SuperNode per app on
    a device, so every round job of the app is this node's; ``keep_request`` is the round now running. A round job
    is one named ``fed-<run>-<round>`` that starts from an imported adapter (the round's global one; no job trained
    it) or from one already gone: an app's own job that happens to have such a name but trains from scratch or on
    from its own adapter is not touched, nor are its adapters.
    """
    adapters = c.list_adapters()
    trained_here = {a.adapter_id for a in adapters if a.job_id}
    rounds = [
        j
        for j in c.list_jobs()
        if ROUND_REQUEST.fullmatch(j.request_id)
        and j.request_id != keep_request
        and j.config.init_adapter_id
        and j.config.init_adapter_id not in trained_here
    ]
    cancelled = 0
    for j in rounds:
        if not j.is_final:
            c.cancel_job(j)
            cancelled += 1
    theirs = {j.config.init_adapter_id for j in rounds} | {j.adapter_id for j in rounds}
    for a in adapters:
        if a.adapter_id in theirs:
            try:
                c.delete_adapter(a.adapter_id)
            except (lc.NotFound, lc.FailedPrecondition):
                pass  # deleted meanwhile, or an app's own unfinished job trains on from it: left for a later round
    return cancelled


def _train(c: lc.Client, node: NodeSettings, plan: RoundPlan, arrays: Arrays) -> RoundResult:
    reap_orphans(c, round_request_id(plan))
    status = c.device_status()
    if not status.can_train and node.gate_wait_s <= 0:
        return RoundResult(declined=(status.blocked_reasons or (lc.BlockedReason.CONDITIONS_UNKNOWN,))[0].value)
    start = global_tensors(plan, arrays)
    imported = c.import_adapter(peft_tar(plan.fed, start), plan.fed.base_model_sha256, node.base_model)
    job = None
    try:
        cfg = lc.TrainingConfig(
            base_model=node.base_model,
            init_adapter_id=imported.adapter_id,
            freeze_lora_a=plan.mode == "ffa",
            max_steps=plan.steps,
            learning_rate=plan.learning_rate,
            seq_len=plan.seq_len,
            batch_size=plan.batch_size,
            seed=plan.fed.seed + plan.server_round,
            eval_fraction=0.2,
            eval_every_steps=plan.steps,
            checkpoint_every_steps=plan.steps,
        )
        job = c.create_job(node.datasets, cfg, request_id=round_request_id(plan))
        job = _wait(c, job, node)
        if job.state != lc.JobState.SUCCEEDED:
            if not job.is_final:
                c.cancel_job(job)
                return RoundResult(
                    declined=job.blocked_reason.value if job.blocked_reason.value != "none" else "timeout"
                )
            return RoundResult(declined=f"job_{job.error.code if job.error else job.state.value}")
        adapter = c.get_adapter(job.adapter_id)
        with tempfile.TemporaryDirectory(prefix="lorad-fed-") as tmp:
            path = Path(tmp) / "update.tar"
            c.download_adapter(job, path)
            _, trained = read_peft_tar(path.read_bytes())
        keep = (".lora_B.weight",) if plan.mode == "ffa" else (".lora_A.weight", ".lora_B.weight")
        update = {k: v for k, v in trained.items() if k.endswith(keep)}
        metrics = {
            "train_loss": adapter.train_loss,
            "eval_loss": adapter.eval_loss_after,
            "eval_loss_before": adapter.eval_loss_before,
            "steps": float(adapter.steps),
        }
        return RoundResult(update=update, num_examples=max(1, adapter.sample_count), metrics=metrics)
    finally:
        for ref in (imported.adapter_id, job.adapter_id if job is not None and job.adapter_id else None):
            if ref:
                try:
                    c.delete_adapter(ref)
                except lc.LoradError:
                    pass  # quota housekeeping only; the round's answer does not depend on it


def _wait(c: lc.Client, job: lc.Job, node: NodeSettings) -> lc.Job:
    """Polls until the job is final, or it waited for the gates longer than allowed, or the job timeout passed."""
    t0 = time.monotonic()
    waiting_since: float | None = None
    while not job.is_final:
        now = time.monotonic()
        if job.state in (lc.JobState.WAITING, lc.JobState.PAUSED):
            waiting_since = waiting_since or now
            if now - waiting_since > node.gate_wait_s:
                return job
        else:
            waiting_since = None
        if now - t0 > node.job_timeout_s:
            return job
        time.sleep(GATE_POLL_S / 4 if job.state == lc.JobState.RUNNING else GATE_POLL_S)
        job = c.get_job(job)
    return job


def finite(metrics: Mapping[str, float]) -> dict[str, float]:
    """Metrics with non-finite values as -1 (keys stay the same on every device, as Flower's averaging needs)."""
    return {k: (float(v) if np.isfinite(v) else -1.0) for k, v in metrics.items()}
