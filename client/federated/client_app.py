"""The Flower ClientApp a SuperNode runs next to lorad: each round, one short local job; only the update leaves."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from lorad.client.federated.device import NodeSettings, RoundPlan, RoundResult, finite, run_round
from lorad.client.federated.strategy import META, NUM_EXAMPLES

app = ClientApp()


def reply_content(plan: RoundPlan | None, res: RoundResult) -> RecordDict:
    """The reply: arrays + counts + metrics + the adapter's identity, or a decline code. No samples, no paths."""
    if res.update is None or plan is None:
        declined = ConfigRecord({"status": "declined", "reason": res.declined or "unknown"})
        return RecordDict({"metrics": MetricRecord({NUM_EXAMPLES: 0}), META: declined})
    fed = plan.fed
    meta = ConfigRecord(
        {
            "status": "ok",
            "mode": plan.mode,
            "seed": fed.seed,
            "rank": fed.rank,
            "targets": sorted(fed.targets),
            "base_model_sha256": fed.base_model_sha256,
        }
    )
    arrays = ArrayRecord({k: Array(np.ascontiguousarray(v, np.float32)) for k, v in sorted(res.update.items())})
    metrics = MetricRecord({NUM_EXAMPLES: res.num_examples, **finite(res.metrics or {})})
    return RecordDict({"arrays": arrays, "metrics": metrics, META: meta})


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round: parse the plan, let the local daemon train, answer with the update or a decline."""
    plan: RoundPlan | None = None
    try:
        node = NodeSettings.from_node_config(context.node_config)
        plan = RoundPlan.from_config(msg.content["config"], context.run_id)
        arrays = {k: np.asarray(v.numpy(), np.float32) for k, v in msg.content["arrays"].items()}  # type: ignore[union-attr]
        res = run_round(node, plan, arrays)
    except (KeyError, ValueError, TypeError) as exc:  # a malformed plan or node config: decline, do not crash
        res = RoundResult(declined=f"bad_{type(exc).__name__}")
    return Message(reply_content(plan, res), reply_to=msg)
