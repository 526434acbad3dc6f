"""One training config from the API to the kernel: the API's bounds and defaults are TrainConfig's own."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from lorad.server.engine.training.config import ConfigError, TrainConfig, api_key, api_knobs, job_config, knobs
from lorad.server.errors import InvalidArgument
from lorad.server.records import JobSpec, Requirements, Window
from lorad.server.store._codec import spec_from_json, spec_hash, spec_to_json
from lorad.server.validation import build_job_model, build_params

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _probes(name: str) -> list[Any]:
    """Values on and just beyond each bound of a numeric field."""
    k, default = knobs()[name], FIELDS[name].default
    out: list[Any] = []
    for b in (k.lo, k.hi):
        if b is None:
            continue
        if isinstance(default, int):
            out += [int(b) - 1, int(b), int(b) + 1]
        else:
            out += [math.nextafter(b, -math.inf), float(b), math.nextafter(b, math.inf)]
    return out


def _api_accepts(name: str, value: Any) -> bool:
    raw: dict[str, Any] = {api_key(api_knobs()[name]): value}
    if name == "steps":
        raw["warmup_steps"] = 0
    try:
        build_params(raw)
    except InvalidArgument as e:
        assert e.field.startswith(f"config.{api_knobs()[name].api}"), (name, value, e.field)
        return False
    return True


def _engine_accepts(name: str, value: Any) -> bool:
    try:
        TrainConfig(**{name: value, **({"warmup_steps": 0} if name == "steps" else {})})
    except ConfigError as e:
        assert all(m.startswith(f"{name}=") for m in e.errors), e.errors
        return False
    return True


@pytest.mark.parametrize("name", [n for n, k in api_knobs().items() if k.bounded])
def test_api_and_engine_accept_exactly_the_same_values(name: str) -> None:
    probes = _probes(name)
    assert probes, name
    for v in probes:
        if v == 0:
            continue  # 0 is "unset" in the API (proto3): the job default, tested below
        assert _api_accepts(name, v) == _engine_accepts(name, v), (name, v)


@pytest.mark.parametrize("name", [n for n, k in api_knobs().items() if k.choices])
def test_api_and_engine_accept_the_same_choices(name: str) -> None:
    k = api_knobs()[name]
    as_value = (lambda c: (c,)) if isinstance(FIELDS[name].default, tuple) else (lambda c: c)
    for c in (*k.choices, "nope"):
        engine = _engine_accepts(name, as_value(c))
        if c in ("auto", ""):
            continue  # the API says "auto" by leaving the enum 0
        assert _api_accepts(name, [c] if isinstance(FIELDS[name].default, tuple) else c) == engine, (name, c)


def test_every_bounded_field_is_probed_and_every_api_field_maps_to_a_proto_name() -> None:
    from lorad.server.rpc.convert import training_raw
    from lorad.v1 import common_pb2

    raw_keys = set(training_raw(common_pb2.TrainingConfig()))
    assert {api_key(k) for k in api_knobs().values()} | {"base_model", "init_adapter_id"} == raw_keys
    assert all(k.help for k in knobs().values())


def test_unset_fields_take_the_documented_job_defaults() -> None:
    cfg = build_params({})
    assert cfg == job_config({})
    assert (cfg.rank, cfg.alpha, cfg.steps, cfg.lr, cfg.seq_len) == (8, 16.0, 100, 2e-4, 256)
    assert (cfg.eval_every, cfg.eval_fraction, cfg.checkpoint_every, cfg.min_lr_ratio) == (25, 0.1, 50, 0.1)
    assert build_params({"rank": 4}).alpha == 8.0, "alpha defaults to 2 * rank"
    assert build_params({"lr_schedule": "linear"}).min_lr_ratio == 0.0
    assert build_params({"target_modules": ["q_proj"]}).targets == ("q_proj",)
    assert build_job_model({"base_model": "m", "init_adapter_id": "adp_1"}) == ("m", "adp_1")


def test_messages_name_the_proto_field_and_the_range() -> None:
    with pytest.raises(InvalidArgument) as e:
        build_params({"rank": 500})
    assert e.value.field == "config.lora.rank" and "1 to 128" in str(e.value) and "(0 = 8)" in str(e.value)
    with pytest.raises(InvalidArgument) as e:
        build_params({"warmup_steps": 10, "max_steps": 10})
    assert e.value.field == "config.warmup_steps" and "max_steps=10" in str(e.value)


# Written by lorad before TrainConfig was the job's config type: stored specs must read back and hash the same.
OLD_SPEC = (
    '{"dataset_ids":["ds","notes"],"params":{"alpha":8.0,"backend":"auto","base_model":"tiny","batch_size":1,'
    '"checkpoint_every_steps":50,"dropout":0.0,"eval_every_steps":25,"eval_fraction":0.1,"freeze_lora_a":true,'
    '"grad_accum_steps":1,"init_adapter_id":"adp_x","learning_rate":0.001,"lr_schedule":"linear",'
    '"max_grad_norm":1.0,"max_steps":100,"precision":"fp32","rank":4,"seed":7,"seq_len":256,'
    '"target_modules":["q_proj","v_proj"],"warmup_steps":0,"weight_decay":0.0},"requirements":'
    '{"max_temperature_celsius":40.0,"min_battery_percent":50,"require_charging":true,"require_idle":false},'
    '"window":{"cron":"30 2 * * *","jitter_seconds":60,"timezone":"Europe/Berlin"}}'
)
OLD_HASH = "c5bd02a0f21e5a257792cda59a92519efa9b90cfa8cee96b53c13db3d2bc7526"


def test_stored_specs_keep_their_layout_and_hash() -> None:
    raw = {"rank": 4, "target_modules": ["q_proj", "v_proj"], "learning_rate": 1e-3, "lr_schedule": "linear",
           "freeze_lora_a": True, "seed": 7, "precision": "fp32"}  # fmt: skip
    spec = JobSpec(("ds", "notes"), build_params(raw), Requirements(True, 50, 40.0, False),
                   Window("30 2 * * *", 60, "Europe/Berlin"), base_model="tiny", init_adapter_id="adp_x")  # fmt: skip
    assert spec_to_json(spec) == OLD_SPEC and spec_hash(spec) == OLD_HASH
    back = spec_from_json(OLD_SPEC)
    assert back == spec and back.params.min_lr_ratio == 0.0 and back.params.targets == ("q_proj", "v_proj")
