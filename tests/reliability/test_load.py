"""Load: 24 concurrent clients append, list and watch while a job trains; 0 errors, p50/p99 reported, RSS bounded."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path

import grpc
import pytest

from lorad.v1 import data_pb2, device_pb2, jobs_pb2
from tests.reliability.harness import SubprocessDaemon, append, chat, corpus, create_job, get_job, wait_state

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(300)]

DURATION_S = 20.0
APPENDERS, LISTERS, WATCHERS, STATUS = 10, 6, 5, 3  # 24 clients, each with its own channel
RSS_LIMIT_BYTES = 1536 << 20  # tiny model + torch + gRPC: ~400 MiB measured; 1.5 GiB means something leaks
RSS_GROWTH_LIMIT_BYTES = 150 << 20  # second half of the run vs. the first


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def test_concurrent_clients_while_training(tmp_path: Path, tiny_llama: Path, tally) -> None:
    d = SubprocessDaemon(tmp_path / "load", tiny_llama)
    d.start()
    app = d.register("loadapp")
    token = app.token
    append(app, "train", corpus(24))
    job = create_job(app, "long", ("train",), steps=100_000, checkpoint_every_steps=25, eval_every_steps=50)
    wait_state(app, job.job_id, {jobs_pb2.JOB_STATE_RUNNING}, 60)
    stop = threading.Event()
    lat: dict[str, list[float]] = defaultdict(list)
    errors: list[str] = []
    counts: dict[str, int] = defaultdict(int)
    lock = threading.Lock()

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except grpc.RpcError as e:
            with lock:
                errors.append(f"{name}: {e.code().name} {e.details()}")
            return
        with lock:
            lat[name].append(time.perf_counter() - t0)

    def appender(i: int) -> None:
        s = d.stubs(token)
        n = 0
        while not stop.is_set():
            batch = [chat(f"load {i} {n} {k}?", f"reply {i} {n} {k}") for k in range(10)]
            timed("AppendSamples", lambda: append(s, f"load-{i % 3}", batch, timeout=30))
            n += 1

    def lister(i: int) -> None:
        s = d.stubs(token)
        calls = [
            ("ListSamples", lambda: s.data.ListSamples(data_pb2.ListSamplesRequest(dataset_id="train", page_size=50),
                                                       metadata=s.md, timeout=30)),
            ("ListDatasets", lambda: s.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=s.md, timeout=30)),
            ("GetJob", lambda: get_job(s, job.job_id)),
            ("ListJobs", lambda: s.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=s.md, timeout=30)),
            ("ListJobEvents", lambda: s.jobs.ListJobEvents(jobs_pb2.ListJobEventsRequest(job_id=job.job_id,
                                                                                         page_size=100),
                                                           metadata=s.md, timeout=30)),
        ]  # fmt: skip
        k = i
        while not stop.is_set():
            name, fn = calls[k % len(calls)]
            timed(name, fn)
            k += 1

    def watcher(i: int) -> None:
        s = d.stubs(token)
        last = 0
        while not stop.is_set():
            stream = s.jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=job.job_id, after_event_id=last), metadata=s.md)
            try:
                for m in stream:
                    last = m.event.event_id
                    with lock:
                        counts["watch_events"] += 1
                    if stop.is_set():
                        stream.cancel()
                        break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    with lock:
                        errors.append(f"WatchJob: {e.code().name} {e.details()}")
                return

    def status(i: int) -> None:
        s = d.stubs(token)
        while not stop.is_set():
            timed(
                "GetDeviceStatus",
                lambda: s.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=s.md, timeout=30),
            )
            time.sleep(0.05)

    threads = [threading.Thread(target=f, args=(i,), daemon=True)
               for f, n in ((appender, APPENDERS), (lister, LISTERS), (watcher, WATCHERS), (status, STATUS))
               for i in range(n)]  # fmt: skip
    rss: list[tuple[float, int]] = []
    step0 = get_job(app, job.job_id).progress.step
    t_start = time.monotonic()
    for t in threads:
        t.start()
    while time.monotonic() - t_start < DURATION_S:
        rss.append((time.monotonic() - t_start, d.rss_bytes()))
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(30)
    end = get_job(app, job.job_id)
    app.jobs.CancelJob(jobs_pb2.CancelJobRequest(job_id=job.job_id), metadata=app.md, timeout=30)

    unary = [x for v in lat.values() for x in v]
    n_calls = len(unary)
    p50, p99 = _pct(unary, 0.50) * 1e3, _pct(unary, 0.99) * 1e3
    per = {
        k: f"n={len(v)} p50={_pct(v, 0.5) * 1e3:.1f}ms p99={_pct(v, 0.99) * 1e3:.1f}ms" for k, v in sorted(lat.items())
    }
    half = len(rss) // 2
    first_max = max(r for _, r in rss[:half])
    second_max = max(r for _, r in rss[half:])
    print(f"\nload: {len(threads)} clients for {DURATION_S:.0f}s: {n_calls} unary calls "
          f"({n_calls / DURATION_S:.0f}/s), p50 {p50:.1f} ms, p99 {p99:.1f} ms; {counts['watch_events']} watch events; "
          f"steps trained {end.progress.step - step0}; daemon RSS max {second_max >> 20} MiB")  # fmt: skip
    for k, v in per.items():
        print(f"  {k}: {v}")
    tally.number("load: clients", len(threads))
    tally.number("load: unary calls", f"{n_calls} in {DURATION_S:.0f}s ({n_calls / DURATION_S:.0f}/s)")
    tally.number("load: unary latency", f"p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    tally.number("load: per RPC", per)
    tally.number("load: daemon RSS", f"first half max {first_max >> 20} MiB, second half max {second_max >> 20} MiB")
    tally.number("load: steps trained during the run", end.progress.step - step0)
    tally.number("load: errors", len(errors))
    for e in errors[:20]:
        tally.violation(f"load: {e}")
    assert not errors, errors[:10]
    assert end.state == jobs_pb2.JOB_STATE_RUNNING and end.progress.step > step0, "the job must train during the load"
    assert counts["watch_events"] > 0
    assert second_max < RSS_LIMIT_BYTES, f"daemon RSS {second_max >> 20} MiB"
    assert second_max - first_max < RSS_GROWTH_LIMIT_BYTES, (first_max >> 20, second_max >> 20)
    assert d.stop() == 0
