"""LoraFedAvg: FFA-LoRA aggregation is the exact mean of the devices' ΔW; the naive baseline is not; screening."""

import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, Metadata, MetricRecord, RecordDict

from lorad.client.federated.ledger import Ledger
from lorad.client.federated.lora import FedLora, a_key, b_key, delta_w, module_shapes, seeded_a, seeded_as
from lorad.client.federated.strategy import META, LoraFedAvg

CFG = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2}  # fmt: skip
FED = FedLora(base_model_sha256="ab" * 32, rank=4, alpha=8.0, targets=("q_proj", "down_proj"), seed=7)


def _reply(node: int, arrays: dict, n: int, meta: dict | None = None) -> Message:
    md = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="r",
                  group_id="1", created_at=time.time(), ttl=60, message_type="train")  # fmt: skip
    meta = {"mode": "ffa", "seed": FED.seed, "rank": FED.rank, "targets": list(FED.targets),
            "base_model_sha256": FED.base_model_sha256} | (meta or {})  # fmt: skip
    content = RecordDict({
        "arrays": ArrayRecord({k: Array(np.asarray(v, np.float32)) for k, v in arrays.items()}),
        "metrics": MetricRecord({"num-examples": n, "train_loss": 1.0}),
        META: ConfigRecord(meta),
    })  # fmt: skip
    return Message(content, metadata=md)


def _declined(node: int) -> Message:
    md = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="r",
                  group_id="1", created_at=time.time(), ttl=60, message_type="train")  # fmt: skip
    content = RecordDict({"metrics": MetricRecord({"num-examples": 0}),
                          META: ConfigRecord({"status": "declined", "reason": "not_charging"})})  # fmt: skip
    return Message(content, metadata=md)


def _failed(node: int) -> Message:
    md = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="r",
                  group_id="1", created_at=time.time(), ttl=60, message_type="train")  # fmt: skip
    return Message(Error(code=3, reason="node unavailable"), metadata=md)


@pytest.fixture
def shapes() -> dict:
    return module_shapes(CFG, FED.targets)


def _random_bs(rng: np.random.Generator, shapes: dict) -> dict:
    return {b_key(m): rng.normal(size=(o, FED.rank)).astype(np.float32) for m, (o, _) in shapes.items()}


def test_module_shapes_follow_the_config(shapes) -> None:
    assert shapes == {
        "model.layers.0.self_attn.q_proj": (16, 16),
        "model.layers.0.mlp.down_proj": (16, 24),
        "model.layers.1.self_attn.q_proj": (16, 16),
        "model.layers.1.mlp.down_proj": (16, 24),
    }


def test_seeded_a_is_reproducible_and_per_module() -> None:
    a1 = seeded_a(7, "model.layers.0.self_attn.q_proj", 4, 16)
    assert np.array_equal(a1, seeded_a(7, "model.layers.0.self_attn.q_proj", 4, 16))
    assert not np.array_equal(a1, seeded_a(8, "model.layers.0.self_attn.q_proj", 4, 16))
    assert not np.array_equal(a1, seeded_a(7, "model.layers.1.self_attn.q_proj", 4, 16))
    assert a1.dtype == np.float32 and np.abs(a1).max() <= 1 / 4  # ±1/sqrt(16)


def test_ffa_aggregate_is_the_exact_example_weighted_mean_of_delta_w(shapes) -> None:
    rng = np.random.default_rng(0)
    s = LoraFedAvg(FED, shapes)
    bs = [_random_bs(rng, shapes) for _ in range(3)]
    ns = [10, 30, 60]
    arrays, metrics = s.aggregate_train(1, [_reply(i + 1, b, n) for i, (b, n) in enumerate(zip(bs, ns))])
    assert arrays is not None and metrics is not None and metrics["devices"] == 3
    a = seeded_as(FED, shapes)
    got = delta_w(s.full_tensors(arrays), FED.scale)
    want: dict = {}
    for b, n in zip(bs, ns):
        for m, d in delta_w({**a, **b}, FED.scale).items():
            want[m] = want.get(m, 0) + d * n / sum(ns)
    for m in shapes:
        np.testing.assert_allclose(got[m], want[m], rtol=1e-5, atol=1e-6)
    # Weighting matters: the unweighted mean is a different adapter.
    plain = {k: np.mean([b[k] for b in bs], axis=0) for k in bs[0]}
    m0 = next(iter(shapes))
    assert np.abs(delta_w({**a, **plain}, FED.scale)[m0] - want[m0]).max() > 1e-2


def test_naive_baseline_differs_from_the_mean_of_delta_w(shapes) -> None:
    rng = np.random.default_rng(1)
    s = LoraFedAvg(FED, shapes, mode="naive")
    devices = []
    for _ in range(3):
        t = _random_bs(rng, shapes)
        t |= {a_key(m): rng.normal(size=(FED.rank, i)).astype(np.float32) for m, (_, i) in shapes.items()}
        devices.append(t)
    replies = [_reply(i + 1, t, 5, {"mode": "naive"}) for i, t in enumerate(devices)]
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None
    agg = s.full_tensors(arrays)
    for k in devices[0]:  # each factor is the plain mean of the devices' factor (equal weights)
        np.testing.assert_allclose(agg[k], np.mean([t[k] for t in devices], axis=0), rtol=1e-5, atol=1e-6)
    exact = {m: np.mean([delta_w(t, FED.scale)[m] for t in devices], axis=0) for m in shapes}
    naive = delta_w(agg, FED.scale)
    gap = max(float(np.abs(naive[m] - exact[m]).max() / np.abs(exact[m]).max()) for m in shapes)
    assert gap > 0.1, gap  # mean(B)·mean(A) is far from mean(B·A) on random factors


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        ({"base_model_sha256": "cd" * 32}, "base_model_sha256"),
        ({"rank": 8}, "rank"),
        ({"targets": ["q_proj", "v_proj"]}, "targets"),
        ({"seed": 8}, "seed"),
        ({"mode": "naive"}, "mode"),
    ],
)
def test_mismatched_updates_are_refused_and_the_round_goes_on(shapes, meta, why) -> None:
    rng = np.random.default_rng(2)
    ledger = Ledger()
    s = LoraFedAvg(FED, shapes, ledger=ledger)
    good = _random_bs(rng, shapes)
    replies = [_reply(1, good, 10), _reply(2, _random_bs(rng, shapes), 10, meta), _declined(3), _failed(4)]
    arrays, _ = s.aggregate_train(2, replies)
    assert arrays is not None
    for k, v in good.items():  # only node 1 counted
        np.testing.assert_array_equal(arrays[k].numpy(), v)
    assert [(r, n) for r, n, _ in s.rejected] == [(2, 2)] and why in s.rejected[0][2]
    ups = {e.node_id: (e.status, e.reason) for e in ledger.entries if e.direction == "up"}
    assert ups[1] == ("accepted", "") and ups[2][0] == "rejected"
    assert ups[3] == ("declined", "not_charging") and ups[4] == ("failed", "error_3")
    assert ledger.round_summary(2)["bytes_up"] == sum(e.bytes for e in ledger.entries if e.node_id in (1, 2))


def test_wrong_shapes_and_non_finite_values_are_refused(shapes) -> None:
    rng = np.random.default_rng(3)
    s = LoraFedAvg(FED, shapes)
    bad_shape = _random_bs(rng, shapes)
    k0 = next(iter(bad_shape))
    bad_shape[k0] = bad_shape[k0][:, :2]
    nan = _random_bs(rng, shapes)
    nan[k0][0, 0] = np.nan
    missing = dict(list(_random_bs(rng, shapes).items())[1:])
    arrays, _ = s.aggregate_train(1, [_reply(1, bad_shape, 5), _reply(2, nan, 5), _reply(3, missing, 5)])
    assert arrays is None
    assert sorted(n for _, n, _ in s.rejected) == [1, 2, 3]


def test_only_b_travels_in_ffa_mode(shapes) -> None:
    ffa, naive = LoraFedAvg(FED, shapes), LoraFedAvg(FED, shapes, mode="naive")
    assert all(k.endswith("lora_B.weight") for k in ffa.initial_arrays())
    assert len(naive.initial_arrays()) == 2 * len(ffa.initial_arrays())
    plan = ffa.plan()
    assert plan["seed"] == 7 and plan["mode"] == "ffa" and plan["targets"] == ["down_proj", "q_proj"]


def test_peft_tar_round_trips_the_tensors(shapes) -> None:
    from lorad.client.federated.lora import peft_tar, read_peft_tar

    rng = np.random.default_rng(4)
    t = {**seeded_as(FED, shapes), **_random_bs(rng, shapes)}
    config, back = read_peft_tar(peft_tar(FED, t))
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["target_modules"] == ["down_proj", "q_proj"]
    assert set(back) == set(t) and all(np.array_equal(back[k], t[k]) for k in t)


def test_device_rebuilds_the_servers_adapter_from_the_seed(shapes) -> None:
    from lorad.client.federated.device import RoundPlan, global_tensors

    s = LoraFedAvg(FED, shapes, train_config={"local-steps": 3})
    plan = RoundPlan.from_config(dict(s.plan()), run_id=1)
    assert plan.steps == 3 and plan.fed == FED
    bs = {k: v.numpy() for k, v in s.initial_arrays().items()}
    full = global_tensors(plan, bs)
    want = s.initial_tensors()
    assert set(full) == set(want) and all(np.array_equal(full[k], want[k]) for k in want)


def test_an_error_reply_is_booked_to_the_node_it_answers_for(shapes) -> None:
    ledger = Ledger()
    s = LoraFedAvg(FED, shapes, ledger=ledger)
    sent = Metadata(run_id=1, message_id="msg-42", src_node_id=0, dst_node_id=42, reply_to_message_id="",
                    group_id="1", created_at=time.time(), ttl=60, message_type="train")  # fmt: skip
    s._sent = [Message(RecordDict(), metadata=sent)]
    err = Metadata(run_id=1, message_id="e", src_node_id=1, dst_node_id=0, reply_to_message_id="msg-42",
                   group_id="1", created_at=time.time(), ttl=60, message_type="train")  # fmt: skip
    s.aggregate_train(1, [Message(Error(code=5, reason="node offline"), metadata=err)])
    assert [(e.node_id, e.status) for e in ledger.entries] == [(42, "failed")]


def test_flowers_server_side_dp_clipping_wraps_the_lora_strategy(shapes) -> None:
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    rng = np.random.default_rng(5)
    lora = LoraFedAvg(FED, shapes)
    dp = DifferentialPrivacyServerSideFixedClipping(lora, noise_multiplier=0.0, clipping_norm=0.5,
                                                    num_sampled_clients=2)  # fmt: skip
    dp.current_arrays = lora.initial_arrays()  # what configure_train records (B = 0)
    big = [{k: v * 100 for k, v in _random_bs(rng, shapes).items()} for _ in range(2)]
    arrays, _ = dp.aggregate_train(1, [_reply(1, big[0], 10), _reply(2, big[1], 10), _declined(3)])
    assert arrays is not None
    norm = np.sqrt(sum(float(np.sum(arrays[k].numpy().astype(np.float64) ** 2)) for k in arrays))
    assert norm <= 0.5 + 1e-5  # each device's B update was clipped to 0.5, so their mean is too
    assert [e.status for e in lora.ledger.entries] == ["accepted", "accepted", "declined"]
