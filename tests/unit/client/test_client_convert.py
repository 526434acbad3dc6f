"""Proto <-> dataclass conversion: every enum value maps, unset optionals stay None, round trips are exact."""

from __future__ import annotations

import random

import pytest

from lorad.client import _convert as conv
from lorad.client import types as t
from lorad.client.retry import RetryPolicy
from lorad.v1 import adapters_pb2, common_pb2, inference_pb2, jobs_pb2


@pytest.mark.parametrize(
    ("wrapper", "emap"),
    [
        (common_pb2.Role, conv.ROLE),
        (common_pb2.Backend, conv.BACKEND),
        (common_pb2.Precision, conv.PRECISION),
        (common_pb2.LrSchedule, conv.LR_SCHEDULE),
        (jobs_pb2.JobState, conv.JOB_STATE),
        (jobs_pb2.BlockedReason, conv.BLOCKED),
        (jobs_pb2.JobEventKind, conv.EVENT_KIND),
        (jobs_pb2.JobPhase, conv.PHASE),
        (adapters_pb2.AdapterFormat, conv.ADAPTER_FORMAT),
        (inference_pb2.FinishReason, conv.FINISH),
    ],
)
def test_every_proto_enum_value_has_a_python_member(wrapper, emap) -> None:  # type: ignore[no-untyped-def]
    for name, number in wrapper.items():
        member = emap.py(number)
        if not name.endswith("_UNSPECIFIED"):
            assert member is not None and emap.pb(member) == number, name
    assert emap.py(999) is emap.py(0)  # a value from a newer daemon degrades to "unspecified"


def test_training_config_round_trip() -> None:
    c = t.TrainingConfig(
        base_model="m",
        lora=t.LoraConfig(8, 16.0, 0.05, ("q_proj", "v_proj")),
        max_steps=30,
        learning_rate=1e-3,
        seq_len=128,
        lr_schedule=t.LrSchedule.LINEAR,
        seed=3,
        backend=t.Backend.ORT_CPU,
        precision=t.Precision.W8A8,
    )
    back = conv.training_config(conv.training_config_to_pb(c))
    assert back.lora.alpha == 16.0 and back.lora.target_modules == ("q_proj", "v_proj")
    assert (back.backend, back.precision, back.lr_schedule, back.max_steps) == (
        t.Backend.ORT_CPU,
        t.Precision.W8A8,
        t.LrSchedule.LINEAR,
        30,
    )


def test_requirements_unset_means_daemon_default() -> None:
    pb = conv.requirements_to_pb(t.DeviceRequirements(require_charging=False))
    assert pb.HasField("require_charging") and not pb.HasField("min_battery_percent")
    assert conv.requirements(pb) == t.DeviceRequirements(require_charging=False)


def test_job_without_window_or_error() -> None:
    j = conv.job(
        jobs_pb2.Job(job_id="j", state=jobs_pb2.JOB_STATE_WAITING, blocked_reason=jobs_pb2.BLOCKED_REASON_NOT_CHARGING)
    )
    assert j.window is None and j.error is None and j.progress.eval_loss is None
    assert j.state is t.JobState.WAITING and j.blocked_reason is t.BlockedReason.NOT_CHARGING and not j.is_final


def test_chat_sample_round_trip() -> None:
    s = t.ChatSample((t.ChatMessage(t.Role.USER, "q"), t.ChatMessage(t.Role.ASSISTANT, "a")))
    assert conv.sample(conv.sample_to_pb(s)) == s
    assert conv.sample(conv.sample_to_pb(t.TextSample("x"))) == t.TextSample("x")


def test_backoff_grows_is_capped_and_jittered() -> None:
    p = RetryPolicy(max_attempts=6, initial_backoff_seconds=0.1, max_backoff_seconds=1.0)
    rng = random.Random(0)
    for retry, bound in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0]):
        delays = [p.delay(retry, rng) for _ in range(50)]
        assert all(bound / 2 <= d <= bound for d in delays)
        assert max(delays) - min(delays) > bound / 10  # jittered, not constant
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


def test_job_phase_and_typed_data_summary_reach_the_sdk() -> None:
    m = jobs_pb2.Job(job_id="j", phase=jobs_pb2.JOB_PHASE_PLANNING, phase_fraction=0.4)
    m.progress.data.CopyFrom(jobs_pb2.JobData(total_samples=5, train_samples=3, eval_samples=1, train_tokens=90,
                                              rejected=jobs_pb2.RejectedSamples(too_long=1)))  # fmt: skip
    j = conv.job(m)
    assert j.phase is t.JobPhase.PLANNING and j.phase_fraction == pytest.approx(0.4)
    assert j.progress.data == t.JobData(5, 3, 1, 90, t.RejectedSamples(too_long=1))
    assert j.progress.data.rejected.total == 1
    e = conv.job_event(jobs_pb2.JobEvent(kind=jobs_pb2.JOB_EVENT_KIND_WARNING))
    assert e.kind is t.JobEventKind.WARNING and e.phase is t.JobPhase.UNSPECIFIED and e.phase_fraction is None
    assert conv.job(jobs_pb2.Job()).progress.data is None
