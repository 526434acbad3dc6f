"""Shared request builders and waits for the server tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from lorad.v1 import (
    adapters_pb2_grpc,
    apps_pb2_grpc,
    common_pb2,
    data_pb2,
    data_pb2_grpc,
    device_pb2_grpc,
    inference_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
)

GOOD = {"battery_percent": 90, "charging": True, "temperature_celsius": 30.0, "idle": True}
GOOD_PROBE = {"battery_percent": 90, "charging": True, "temperature_celsius": 30.0, "idle": True}
FINAL = {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}


class Stubs:
    """Sync stubs for every service on one channel, with a bearer token."""

    def __init__(self, channel: grpc.Channel, token: str) -> None:
        self.channel = channel
        self.md = (("authorization", f"Bearer {token}"),)
        self.apps = apps_pb2_grpc.AppServiceStub(channel)
        self.data = data_pb2_grpc.DataServiceStub(channel)
        self.jobs = jobs_pb2_grpc.JobServiceStub(channel)
        self.adapters = adapters_pb2_grpc.AdapterServiceStub(channel)
        self.inference = inference_pb2_grpc.InferenceServiceStub(channel)
        self.device = device_pb2_grpc.DeviceServiceStub(channel)


def chat(user: str, assistant: str) -> common_pb2.Sample:
    return common_pb2.Sample(chat=common_pb2.Chat(messages=[
        common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content=user),
        common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=assistant),
    ]))  # fmt: skip


def corpus(n: int = 24) -> list[common_pb2.Sample]:
    out = [chat(f"What is note {i} about?", f"Note {i} is about the quick brown fox, item {i}.") for i in range(n)]
    out += [common_pb2.Sample(text=f"Hello world {i}! The lazy dog sleeps.") for i in range(n // 2)]
    return out


def append(stubs: Any, dataset: str = "notes", samples: list[common_pb2.Sample] | None = None) -> Any:
    return stubs.data.AppendSamples(
        data_pb2.AppendSamplesRequest(dataset_id=dataset, samples=samples or corpus()), metadata=stubs.md
    )


def tiny_config(steps: int = 6, **kw: Any) -> common_pb2.TrainingConfig:
    base = dict(max_steps=steps, seq_len=64, eval_fraction=0.3, batch_size=2, learning_rate=1e-3, eval_every_steps=3,
                checkpoint_every_steps=2, seed=7, lora=common_pb2.LoraConfig(rank=4))  # fmt: skip
    base.update(kw)
    return common_pb2.TrainingConfig(**base)


def create_job(stubs: Any, request_id: str = "r1", datasets: tuple[str, ...] = ("notes",), **cfg: Any) -> Any:
    return stubs.jobs.CreateJob(
        jobs_pb2.CreateJobRequest(request_id=request_id, dataset_ids=list(datasets), config=tiny_config(**cfg)),
        metadata=stubs.md,
    ).job


def wait_for(cond: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def get_job(stubs: Any, job_id: str) -> Any:
    return stubs.jobs.GetJob(jobs_pb2.GetJobRequest(job_id=job_id), metadata=stubs.md).job


def wait_state(stubs: Any, job_id: str, states: set[int], timeout_s: float = 60.0) -> Any:
    return wait_for(lambda: (j := get_job(stubs, job_id)).state in states and j, timeout_s,
                    f"job {job_id} in {[jobs_pb2.JobState.Name(s) for s in states]}")  # fmt: skip


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    try:
        fn()
    except grpc.RpcError as e:
        trailing = {k: v for k, v in (e.trailing_metadata() or ())}
        return e.code(), e.details(), trailing
    raise AssertionError("call succeeded; expected an error")
