"""Graceful shutdown: health says NOT_SERVING (and RPCs UNAVAILABLE) while the running job checkpoints."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorad.server.jobs.session import SessionOutcome, SessionSink
from lorad.v1 import jobs_pb2
from tests.integration.helpers import append, create_job, wait_for

pytestmark = pytest.mark.integration
CHECKPOINT_S = 1.5  # how long the scripted session takes to "write its checkpoint" once told to stop


class SlowToStop:
    def __init__(self, started: threading.Event, stopping: threading.Event) -> None:
        self.started, self.stopping = started, stopping

    def run(self, should_stop: Callable[[], bool], sink: SessionSink) -> SessionOutcome:
        self.started.set()
        while not should_stop():
            time.sleep(0.01)
        self.stopping.set()
        time.sleep(CHECKPOINT_S)
        return SessionOutcome(completed=False)


def test_health_is_not_serving_while_shutting_down(make_daemon) -> None:
    started, stopping = threading.Event(), threading.Event()
    d = make_daemon(factory=lambda req: SlowToStop(started, stopping))
    app, _ = d.register("notes")
    append(app)
    create_job(app, steps=5)
    assert started.wait(30)
    health = health_pb2_grpc.HealthStub(d.channel())
    check = health_pb2.HealthCheckRequest
    assert health.Check(check(service=""), timeout=5).status == health_pb2.HealthCheckResponse.SERVING

    stopped = asyncio.run_coroutine_threadsafe(d.daemon.stop(), d.loop)
    assert stopping.wait(10), "the running job was asked to checkpoint"
    # The job is still checkpointing, so the server has not stopped: it answers, and says it is going away.
    assert not stopped.done()
    for name in ("", "lorad.v1.JobService"):
        assert health.Check(check(service=name), timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        app.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=app.md, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (err.value.details() or "")
    assert not stopped.done()
    stopped.result(30)
    wait_for(lambda: not d.daemon.socket_path.exists(), 5, "socket removed")
    d.loop.call_soon_threadsafe(d.loop.stop)
    d.thread.join(10)
