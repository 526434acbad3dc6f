"""The Flower ServerApp: LoraFedAvg rounds, a PEFT adapter per round, the ledger; optional central DP."""

from __future__ import annotations

import json
import logging
import shutil
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, Strategy

from lorad.client.federated.ledger import Ledger
from lorad.client.federated.lora import Arrays, FedLora, module_shapes, peft_tar
from lorad.client.federated.strategy import LoraFedAvg

log = logging.getLogger("lorad.federated.server")
app = ServerApp()


@dataclass(frozen=True)
class ServerSettings:
    """The run config (`[tool.flwr.app.config]`, overridable with `flwr run --run-config`)."""

    base_model_sha256: str
    model_config: Path  # the base model's config.json: module shapes
    out_dir: Path
    rounds: int = 3
    mode: str = "ffa"
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    seed: int = 0
    local_steps: int = 10
    learning_rate: float = 1e-3
    seq_len: int = 256
    batch_size: int = 1
    fraction_train: float = 1.0
    min_train_nodes: int = 2
    min_available_nodes: int = 2
    round_timeout_s: float = 600.0
    dp_noise_multiplier: float = 0.0  # > 0 with dp_clipping_norm > 0: central DP (server-side fixed clipping)
    dp_clipping_norm: float = 0.0

    @classmethod
    def from_run_config(cls, c: Mapping[str, Any]) -> ServerSettings:
        """Parses the run config (kebab-case keys).

        Raises:
            ValueError: a required key is missing (named).
        """
        missing = [k for k in ("base-model-sha256", "model-config") if not c.get(k)]
        if missing:
            raise ValueError(f"run config lacks {missing}; pass them with flwr run --run-config")
        d = cls.__dataclass_fields__
        kw: dict[str, Any] = {}
        for name in d:
            key = {
                "round_timeout_s": "round-timeout",
                "dp_noise_multiplier": "dp-noise",
                "dp_clipping_norm": "dp-clip",
            }.get(name, name.replace("_", "-"))
            if key in c:
                kw[name] = c[key]
        kw["model_config"] = Path(str(kw["model_config"])).expanduser()
        kw["out_dir"] = Path(str(c.get("out-dir", "lorad-federated"))).expanduser()
        if isinstance(kw.get("targets"), str):
            kw["targets"] = tuple(t.strip() for t in kw["targets"].split(",") if t.strip())
        for name in (
            "rounds",
            "rank",
            "seed",
            "local_steps",
            "seq_len",
            "batch_size",
            "min_train_nodes",
            "min_available_nodes",
        ):
            if name in kw:
                kw[name] = int(kw[name])
        return cls(**kw)


def write_round(out_dir: Path, fed: FedLora, server_round: int, tensors: Arrays) -> Path:
    """Writes round N's global adapter as a PEFT folder `round-NNN` (built aside, then renamed into place)."""
    dest = out_dir / f"round-{server_round:03d}"
    tmp = out_dir / f".tmp-round-{server_round:03d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(fileobj=BytesIO(peft_tar(fed, tensors)), mode="r:") as tar:
        for m in tar.getmembers():
            f = tar.extractfile(m)
            assert f is not None
            (tmp / m.name).write_bytes(f.read())
    (tmp / "lorad_federation.json").write_text(
        json.dumps(
            {
                "round": server_round,
                "base_model_hash": fed.base_model_sha256,
                "seed": fed.seed,
                "rank": fed.rank,
                "alpha": fed.alpha,
                "targets": sorted(fed.targets),
                "written_at": time.time(),
            },
            indent=2,
        )
    )
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)
    return dest


def build_strategy(s: ServerSettings, ledger: Ledger) -> tuple[LoraFedAvg, Strategy]:
    """(the LoRA strategy, the strategy to run: it, or it wrapped in Flower's server-side DP clipping)."""
    fed = FedLora(base_model_sha256=s.base_model_sha256, rank=s.rank, alpha=s.alpha, targets=s.targets, seed=s.seed)
    shapes = module_shapes(json.loads(s.model_config.read_text()), s.targets)
    lora = LoraFedAvg(
        fed,
        shapes,
        mode=s.mode,
        ledger=ledger,
        on_round=lambda r, t: log.info("round_adapter %s", write_round(s.out_dir, fed, r, t)),
        train_config={
            "local-steps": s.local_steps,
            "learning-rate": s.learning_rate,
            "seq-len": s.seq_len,
            "batch-size": s.batch_size,
        },
        fraction_train=s.fraction_train,
        min_train_nodes=s.min_train_nodes,
        min_available_nodes=s.min_available_nodes,
    )
    if s.dp_noise_multiplier > 0 and s.dp_clipping_norm > 0:
        return lora, DifferentialPrivacyServerSideFixedClipping(
            lora, s.dp_noise_multiplier, s.dp_clipping_norm, num_sampled_clients=s.min_train_nodes
        )
    return lora, lora


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Runs the rounds; writes round-NNN/ adapters, ledger.jsonl and summary.json under out-dir."""
    s = ServerSettings.from_run_config(context.run_config)
    s.out_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(s.out_dir / "ledger.jsonl")
    lora, strategy = build_strategy(s, ledger)
    t0 = time.monotonic()
    result = strategy.start(grid, initial_arrays=lora.initial_arrays(), num_rounds=s.rounds, timeout=s.round_timeout_s)
    summary = {
        "rounds": s.rounds,
        "mode": s.mode,
        "seconds": round(time.monotonic() - t0, 3),
        "round_seconds": lora.round_seconds,
        "per_round": {r: ledger.round_summary(r) for r in range(1, s.rounds + 1)},
        "train_metrics": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
        "rejected": [{"round": r, "node_id": n, "reason": why} for r, n, why in lora.rejected],
    }
    (s.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
