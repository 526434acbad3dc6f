"""LoRA-aware FedAvg: FFA-LoRA (seeded frozen A, B averaged by examples; exact) or naive A/B averaging (baseline)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from lorad.client.federated.ledger import Ledger, payload_bytes
from lorad.client.federated.lora import (
    Arrays,
    FedLora,
    UpdateMismatchError,
    b_key,
    check_update,
    module_of,
    seeded_as,
    zero_bs,
)

log = logging.getLogger("lorad.federated.strategy")

MODES = ("ffa", "naive")
META = "meta"  # ConfigRecord key: the update's base hash, rank, targets, seed (replies) / the round's plan (requests)
NUM_EXAMPLES = "num-examples"


def reply_status(msg: Message) -> tuple[str, str]:
    """("ok" | "declined" | "failed", reason code) of a reply; a reason is a code, never free text from a device."""
    if msg.has_error():
        return "failed", f"error_{msg.error.code}"
    meta = msg.content.config_records.get(META)
    if meta is not None and meta.get("status") == "declined":
        return "declined", str(meta.get("reason", ""))[:64]
    return "ok", ""


class LoraFedAvg(FedAvg):
    """FedAvg over LoRA factors, built on Flower's FedAvg (sampling, weighting by ``num-examples``, metrics).

    ``mode="ffa"`` (default): every A is drawn from ``fed.seed`` (devices regenerate it; only the seed is sent), the
    global arrays are the Bs, and the example-weighted mean of B gives exactly the mean of the devices' ΔW = s·B·A.
    ``mode="naive"``: A and B are both trained and averaged separately: mean(B)·mean(A) ≠ mean(B·A) (a baseline).

    Replies made for another base model, rank, targets or seed, or with other tensor shapes, are refused (logged
    with the node id and the field, and recorded in the ledger); declined and failed devices do not stop a round.
    """

    def __init__(
        self,
        fed: FedLora,
        shapes: Mapping[str, tuple[int, int]],
        *,
        mode: str = "ffa",
        ledger: Ledger | None = None,
        on_round: Callable[[int, Arrays], None] | None = None,
        train_config: Mapping[str, int | float | str | bool] | None = None,
        **fedavg: object,
    ) -> None:
        """Args:
        fed: what every update must share (base hash, rank, alpha, targets, seed).
        shapes: (out_features, in_features) by module name (``lora.module_shapes``).
        mode: "ffa" or "naive".
        ledger: where bytes per device per round are recorded.
        on_round: called with (round, full adapter tensors A and B) after each aggregation (round 0: the start).
        train_config: extra job settings sent to devices each round (e.g. steps, lr).
        fedavg: FedAvg's keyword arguments (fraction_train, min_train_nodes, min_available_nodes, ...).
        """
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {MODES}")
        fedavg.setdefault("fraction_evaluate", 0.0)  # devices report the incoming adapter's loss while training
        super().__init__(**fedavg)  # type: ignore[arg-type]
        self.fed, self.mode, self.shapes = fed, mode, dict(shapes)
        self.ledger = ledger or Ledger()
        self.on_round = on_round
        self.train_config = dict(train_config or {})
        self.a = seeded_as(fed, shapes)  # FFA's frozen A; the naive baseline's starting A
        self.expected = {k: v.shape for k, v in self.initial_arrays().items()}
        self.rejected: list[tuple[int, int, str]] = []  # (round, node_id, reason)
        self.round_seconds: dict[int, float] = {}  # wall time from sending to aggregating, s
        self._started: dict[int, float] = {}
        self._current: ArrayRecord | None = None  # the global arrays sent this round
        self._sent: list[Message] = []

    # -- the global state -----------------------------------------------------------------------------------------
    def initial_tensors(self) -> Arrays:
        """The round-0 adapter: seeded A, zero B."""
        return {**self.a, **zero_bs(self.fed, self.shapes)}

    def initial_arrays(self) -> ArrayRecord:
        """What travels to devices in round 1: B (ffa) or A and B (naive)."""
        t = self.initial_tensors()
        keys = sorted(k for k in t if self.mode == "naive" or k.endswith(".lora_B.weight"))
        return ArrayRecord({k: Array(t[k]) for k in keys})

    def full_tensors(self, arrays: ArrayRecord) -> Arrays:
        """The complete adapter for global arrays: the seeded A added back in FFA mode."""
        got = {k: np.asarray(v.numpy(), np.float32) for k, v in arrays.items()}
        return got if self.mode == "naive" else {**self.a, **got}

    def plan(self) -> ConfigRecord:
        """The round's settings devices must follow and echo back."""
        fan_in = [self.shapes[module_of(k)][1] for k in sorted(b_key(m) for m in self.shapes)]
        return ConfigRecord(
            {
                "mode": self.mode,
                "seed": self.fed.seed,
                "rank": self.fed.rank,
                "alpha": self.fed.alpha,
                "targets": sorted(self.fed.targets),
                "in_features": fan_in,
                "base_model_sha256": self.fed.base_model_sha256,
                **self.train_config,
            }
        )

    # -- Flower hooks ---------------------------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's sampling, with the LoRA plan in the config and the bytes sent recorded per device."""
        self._started[server_round] = time.monotonic()
        self._current = arrays
        if server_round == 1 and self.on_round is not None:
            self.on_round(0, self.full_tensors(arrays))
        for k, val in self.plan().items():
            config[k] = val
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._sent = messages  # the grid fills in their message ids when it pushes them
        for m in messages:
            self.ledger.add(server_round, m.metadata.dst_node_id, "down", payload_bytes(m.content), "sent")
        return messages

    def _screen(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        accepted = []
        # An error reply (e.g. the device vanished) comes from the SuperLink: attribute it to the node it replies for.
        dst = {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent if m.metadata.message_id}
        for msg in replies:
            node = dst.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
            status, reason = reply_status(msg)
            nbytes = 0 if msg.has_error() else payload_bytes(msg.content)
            if status == "ok":
                try:
                    self._check(msg)
                except UpdateMismatchError as exc:
                    status, reason = "rejected", str(exc)[:120]
                    self.rejected.append((server_round, node, reason))
                    log.warning("update_rejected round=%d node=%d reason=%s", server_round, node, reason)
            else:
                log.info("device_%s round=%d node=%d reason=%s", status, server_round, node, reason)
            self.ledger.add(server_round, node, "up", nbytes, "accepted" if status == "ok" else status, reason=reason)
            if status == "ok":
                accepted.append(msg)
        return accepted

    def _check(self, msg: Message) -> None:
        c = msg.content
        meta = c.config_records.get(META)
        if meta is None or len(c.array_records) != 1 or len(c.metric_records) != 1:
            raise UpdateMismatchError("reply lacks its meta, arrays or metrics record")
        metrics = next(iter(c.metric_records.values()))
        n = metrics.get(NUM_EXAMPLES)
        if not isinstance(n, (int, float)) or isinstance(n, bool) or not n > 0:
            raise UpdateMismatchError(f"{NUM_EXAMPLES}={n!r}: must be > 0")
        if meta.get("mode") != self.mode:
            raise UpdateMismatchError(f"mode {meta.get('mode')!r} != {self.mode!r}")
        arrays = {k: v.numpy() for k, v in next(iter(c.array_records.values())).items()}
        check_update(self.fed, dict(meta), arrays, self.expected)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screens replies (declined, failed, mismatched are left out), then FedAvg's example-weighted mean."""
        accepted = self._screen(server_round, replies)
        if server_round in self._started:
            self.round_seconds[server_round] = round(time.monotonic() - self._started[server_round], 3)
        log.info(
            "round_screened round=%d accepted=%d summary=%s",
            server_round,
            len(accepted),
            self.ledger.round_summary(server_round),
        )
        if not accepted:  # the global adapter stays; its round file is still written
            if self.on_round is not None and self._current is not None:
                self.on_round(server_round, self.full_tensors(self._current))
            return None, None
        arrays, metrics = super().aggregate_train(server_round, accepted)
        if arrays is not None:
            arrays = ArrayRecord({k: Array(np.asarray(arrays[k].numpy(), np.float32)) for k in sorted(arrays.keys())})
            if self.on_round is not None:
                self.on_round(server_round, self.full_tensors(arrays))
        if metrics is not None:
            metrics["devices"] = len(accepted)
        return arrays, metrics
