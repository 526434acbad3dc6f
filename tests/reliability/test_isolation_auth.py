"""Isolation and auth: app B cannot reach app A; bad tokens are UNAUTHENTICATED; no traversal; modes; no sample text."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import grpc
import pytest

from lorad.v1 import adapters_pb2, apps_pb2, common_pb2, data_pb2, device_pb2, inference_pb2, jobs_pb2
from tests.reliability.harness import (
    FINAL,
    SubprocessDaemon,
    append,
    chat,
    code_of,
    corpus,
    create_job,
    diff_snapshots,
    get_job,
    iter_tree,
    store_snapshot,
    tiny_config,
    wait_state,
)
from tests.reliability.rpcs import all_rpcs, call_raw

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(300)]

CANARY = "CANARY-7f3a9c1e-do-not-log"
A_ID, B_ID = "alpha-private", "bravo"
A_DS = "alpha-diary"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    """A subprocess daemon; app A with a canary dataset, a finished job + adapter, a paused job and a schedule."""
    d = SubprocessDaemon(tmp_path_factory.mktemp("iso"), tiny_llama)
    d.start()
    a = d.register(A_ID)
    b = d.register(B_ID)
    samples = [*corpus(12, tag=CANARY), chat(f"secret {CANARY} q", f"secret {CANARY} a")]
    append(a, A_DS, samples)
    done = create_job(a, "a-done", (A_DS,), steps=4)
    done = wait_state(a, done.job_id, FINAL, 120)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.error
    paused = create_job(a, "a-paused", (A_DS,), steps=400, checkpoint_every_steps=2)
    wait_state(a, paused.job_id, {jobs_pb2.JOB_STATE_RUNNING}, 60)
    # Let it write a checkpoint, then pause it: A now owns checkpoints, a paused job and events.
    import time

    time.sleep(1.5)
    a.jobs.PauseJob(jobs_pb2.PauseJobRequest(job_id=paused.job_id), metadata=a.md, timeout=10)
    paused = wait_state(a, paused.job_id, {jobs_pb2.JOB_STATE_PAUSED}, 60)
    sched = a.jobs.CreateSchedule(jobs_pb2.CreateScheduleRequest(
        dataset_ids=[A_DS], config=tiny_config(4), window=common_pb2.TrainingWindow(cron="30 2 * * *")),
        metadata=a.md, timeout=10).schedule  # fmt: skip
    # Generate once with the canary as prompt: inference paths must not log it either.
    list(a.inference.Generate(inference_pb2.GenerateRequest(adapter_id=done.adapter_id, text=f"hi {CANARY}",
                                                            max_tokens=4), metadata=a.md, timeout=60))  # fmt: skip
    ids = {"dataset": A_DS, "job": done.job_id, "paused_job": paused.job_id, "adapter": done.adapter_id,
           "schedule": sched.schedule_id}  # fmt: skip
    yield d, a, b, ids
    d.stop()


def _b_attacks(b, ids: dict[str, str], sub: dict[str, str]) -> list[tuple[str, object]]:
    """Every app-scoped RPC aimed at A's resources (``sub`` replaces ids to get the 'absent' twin)."""
    g = lambda k: sub.get(k, ids[k])  # noqa: E731
    md = b.md
    return [
        ("GetDataset", lambda: b.data.GetDataset(data_pb2.GetDatasetRequest(dataset_id=g("dataset")), metadata=md)),
        ("ListSamples", lambda: b.data.ListSamples(data_pb2.ListSamplesRequest(dataset_id=g("dataset")), metadata=md)),
        (
            "DeleteDataset",
            lambda: b.data.DeleteDataset(data_pb2.DeleteDatasetRequest(dataset_id=g("dataset")), metadata=md),
        ),
        (
            "CreateJob",
            lambda: b.jobs.CreateJob(
                jobs_pb2.CreateJobRequest(request_id="b1", dataset_ids=[g("dataset")], config=tiny_config(4)),
                metadata=md,
            ),
        ),
        (
            "CreateSchedule",
            lambda: b.jobs.CreateSchedule(
                jobs_pb2.CreateScheduleRequest(
                    dataset_ids=[g("dataset")], window=common_pb2.TrainingWindow(cron="0 3 * * *")
                ),
                metadata=md,
            ),
        ),
        *[
            (
                f"{n}[{k}]",
                (lambda n=n, k=k: getattr(b.jobs, n)(getattr(jobs_pb2, f"{n}Request")(job_id=g(k)), metadata=md)),
            )
            for n in ("GetJob", "PauseJob", "ResumeJob", "CancelJob", "ListJobEvents", "ListCheckpoints")
            for k in ("job", "paused_job")
        ],
        ("WatchJob", lambda: list(b.jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=g("job")), metadata=md, timeout=10))),
        (
            "DeleteSchedule",
            lambda: b.jobs.DeleteSchedule(jobs_pb2.DeleteScheduleRequest(schedule_id=g("schedule")), metadata=md),
        ),
        (
            "GetAdapter",
            lambda: b.adapters.GetAdapter(adapters_pb2.GetAdapterRequest(adapter_id=g("adapter")), metadata=md),
        ),
        (
            "DownloadAdapter",
            lambda: list(
                b.adapters.DownloadAdapter(
                    adapters_pb2.DownloadAdapterRequest(adapter_id=g("adapter")), metadata=md, timeout=10
                )
            ),
        ),
        (
            "DeleteAdapter",
            lambda: b.adapters.DeleteAdapter(adapters_pb2.DeleteAdapterRequest(adapter_id=g("adapter")), metadata=md),
        ),
        (
            "Generate",
            lambda: list(
                b.inference.Generate(
                    inference_pb2.GenerateRequest(adapter_id=g("adapter"), text="hello", max_tokens=2),
                    metadata=md,
                    timeout=30,
                )
            ),
        ),
        ("ForgetApp", lambda: b.data.ForgetApp(data_pb2.ForgetAppRequest(app_id=A_ID), metadata=md)),
        ("RegisterApp", lambda: b.apps.RegisterApp(apps_pb2.RegisterAppRequest(app_id="evil"), metadata=md)),
        ("ListApps", lambda: b.apps.ListApps(apps_pb2.ListAppsRequest(), metadata=md)),
        ("RevokeApp", lambda: b.apps.RevokeApp(apps_pb2.RevokeAppRequest(app_id=A_ID), metadata=md)),
    ]


def _twin(value: str) -> str:
    """An absent id of the same shape (same length and prefix) as ``value``."""
    return value[:-4] + ("zzzz" if not value.endswith("zzzz") else "yyyy")


def test_app_b_cannot_reach_app_a(world, tally) -> None:
    d, a, b, ids = world
    before = store_snapshot(d.data_dir)
    log_start = len(d.log_lines())
    twins = {k: _twin(v) for k, v in ids.items()}
    bad = []
    for (name, theirs), (_, absent) in zip(_b_attacks(b, ids, {}), _b_attacks(b, ids, twins), strict=True):
        c1, m1 = code_of(theirs)
        c2, m2 = code_of(absent)
        for k in ids:
            m1 = m1.replace(ids[k], "<ID>")
            m2 = m2.replace(twins[k], "<ID>")
        if c1 not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
            bad.append(f"{name}: B on A's resource got {c1.name} {m1!r}")
        if (c1, m1) != (c2, m2):
            bad.append(f"{name}: A's resource ({c1.name} {m1!r}) distinguishable from absent ({c2.name} {m2!r})")
        if A_ID in m1 or CANARY in m1:
            bad.append(f"{name}: error leaks A: {m1!r}")
    # Listings and device status show nothing of A.
    assert not b.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=b.md).datasets
    assert not b.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=b.md).jobs
    assert not b.adapters.ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=b.md).adapters
    assert not b.jobs.ListSchedules(jobs_pb2.ListSchedulesRequest(), metadata=b.md).schedules
    st = b.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=b.md)
    if st.current_job_id or A_ID in str(st):
        bad.append(f"GetDeviceStatus for B shows A's job {st.current_job_id!r}")
    after = store_snapshot(d.data_dir)
    changed = diff_snapshots(before, after)
    if changed:
        bad.append(f"B's refused calls changed the store: {changed}")
    # The same request_id and dataset name as A's give B its own, separate resources.
    r = append(b, A_DS, [common_pb2.Sample(text="bravo's own sample")])
    assert r.accepted_count == 1 and r.dataset.sample_count == 1
    jb = create_job(b, "a-done", (A_DS,), steps=2)
    assert jb.job_id not in ids.values()
    b.jobs.CancelJob(jobs_pb2.CancelJobRequest(job_id=jb.job_id), metadata=b.md)
    assert get_job(a, ids["paused_job"]).state == jobs_pb2.JOB_STATE_PAUSED
    # B's log lines (bound app_id=bravo) never mention A.
    for line in d.log_lines()[log_start:]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("app_id") == B_ID and (A_ID in line or CANARY in line):
            bad.append(f"log line of B's call leaks A: {line[:200]}")
    for v in bad:
        tally.violation(f"isolation: {v}")
    assert not bad, "\n".join(bad)


def test_unauthenticated_everywhere(world, tally) -> None:
    d, _a, b, _ids = world
    o = d.owner()
    c = d.register("charlie")
    o.apps.RevokeApp(apps_pb2.RevokeAppRequest(app_id="charlie"), metadata=o.md, timeout=10)
    creds = {"none": (), "wrong": (("authorization", "Bearer " + "x" * 43),),
             "revoked": c.md, "malformed": (("authorization", "Basic dXNlcjpwYXNz"),),
             "empty-bearer": (("authorization", "Bearer "),)}  # fmt: skip
    bad = []
    n = 0
    for rpc in all_rpcs():
        for label, md in creds.items():
            code, msg, _ = call_raw(o.channel, rpc, b"", md, timeout=10)
            n += 1
            if code != grpc.StatusCode.UNAUTHENTICATED:
                bad.append(f"{rpc.name} with {label} token → {code.name} {msg!r}")
    # The owner token on app-scoped RPCs and an app token on owner RPCs: PERMISSION_DENIED, never data.
    for rpc in all_rpcs():
        if rpc.name in ("GetDeviceStatus", "GetDiskUsage", "CollectGarbage"):
            continue  # both kinds of token by design: an app sees/cleans its own files, the owner everything
        md = b.md if rpc.path.startswith("/lorad.v1.AppService/") else o.md
        if rpc.name == "ForgetApp":
            continue  # the owner may forget any app (with an app_id); covered by the traversal test
        code, msg, _ = call_raw(o.channel, rpc, b"", md, timeout=10)
        if code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT):
            bad.append(f"{rpc.name} with the wrong kind of token → {code.name} {msg!r}")
    for v in bad:
        tally.violation(f"auth: {v}")
    tally.number("auth: calls with missing/wrong/revoked/malformed tokens", n)
    assert not bad, "\n".join(bad)


def test_revocation_ends_open_watch(world, tally) -> None:
    """A WatchJob stream opened before RevokeApp must not keep streaming the app's events afterwards."""
    import threading
    import time

    d, _a, _b, _ids = world
    o = d.owner()
    e = d.register("echo")
    append(e, "ds", corpus(6, tag="echo"))
    # 30 °C on the probe > 20 °C required: the job parks in WAITING and its watch stream stays open.
    job = e.jobs.CreateJob(
        jobs_pb2.CreateJobRequest(
            request_id="e1",
            dataset_ids=["ds"],
            config=tiny_config(2),
            requirements=common_pb2.DeviceRequirements(max_temperature_celsius=20.0),
        ),
        metadata=e.md,
    ).job
    wait_state(e, job.job_id, {jobs_pb2.JOB_STATE_WAITING}, 30)
    result: dict[str, object] = {}

    def watch() -> None:
        try:
            for _ in e.jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=job.job_id), metadata=e.md, timeout=15):
                pass
            result["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            result["code"] = exc.code()
        result["t"] = time.monotonic()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    o.apps.RevokeApp(apps_pb2.RevokeAppRequest(app_id="echo"), metadata=o.md, timeout=10)
    t.join(16)
    code = result.get("code")
    ended_after = (result["t"] - t0) if "t" in result else None  # type: ignore[operator]
    tally.number("auth: open WatchJob after RevokeApp ended with", f"{code} after {ended_after}s")
    ok = code == grpc.StatusCode.UNAUTHENTICATED and ended_after is not None and ended_after < 5
    if not ok:
        tally.violation(f"auth: WatchJob stream kept running after RevokeApp (ended {code} after {ended_after}s)")
    assert ok, (code, ended_after)


TRAVERSAL = ["../x", "..", ".", "a/b", "a\\b", "/etc", "x/../../y", "..%2f", "a\x00b", "~root", "A", "a" * 65, ""]


def test_names_with_separators_or_traversal_rejected(world, tally) -> None:
    d, _a, b, _ids = world
    o = d.owner()
    outside = sorted(p.name for p in d.root.parent.iterdir())
    bad = []
    for name in TRAVERSAL:
        calls = {
            "RegisterApp": lambda: o.apps.RegisterApp(apps_pb2.RegisterAppRequest(app_id=name), metadata=o.md),
            "AppendSamples": lambda: append(b, name, [common_pb2.Sample(text="t")]),
            "CreateJob": lambda: b.jobs.CreateJob(
                jobs_pb2.CreateJobRequest(request_id="t", dataset_ids=[name]), metadata=b.md
            ),
            "ForgetApp(owner)": lambda: o.data.ForgetApp(data_pb2.ForgetAppRequest(app_id=name), metadata=o.md),
        }
        for label, fn in calls.items():
            code, msg = code_of(fn)
            if code != grpc.StatusCode.INVALID_ARGUMENT:
                bad.append(f"{label}({name!r}) → {code.name} {msg!r}")
        for label, fn in {
            "GetJob": lambda: b.jobs.GetJob(jobs_pb2.GetJobRequest(job_id=name or "x/../y"), metadata=b.md),
            "GetAdapter": lambda: b.adapters.GetAdapter(
                adapters_pb2.GetAdapterRequest(adapter_id=name or "../a"), metadata=b.md
            ),
            "base_model": lambda: b.jobs.CreateJob(
                jobs_pb2.CreateJobRequest(
                    request_id="bm", dataset_ids=[A_DS], config=common_pb2.TrainingConfig(base_model=name or "../m")
                ),
                metadata=b.md,
            ),
        }.items():
            code, msg = code_of(fn)
            if code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                bad.append(f"{label}({name!r}) → {code.name} {msg!r}")
    # The daemon loads models only by their configured name, never a caller-supplied path.
    code, msg = code_of(lambda: b.jobs.CreateJob(jobs_pb2.CreateJobRequest(
        request_id="bm2", dataset_ids=[A_DS], config=common_pb2.TrainingConfig(base_model=str(d.root))),
        metadata=b.md))  # fmt: skip
    if code == grpc.StatusCode.OK:
        bad.append("CreateJob accepted a filesystem path as base_model")
    assert sorted(p.name for p in d.root.parent.iterdir()) == outside
    assert not list((d.data_dir / "apps").glob("*/..*"))
    for v in bad:
        tally.violation(f"names: {v}")
    assert not bad, "\n".join(bad)


def test_permissions(world, tally) -> None:
    d, *_ = world
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    problems = []
    if mode(d.socket_path) != 0o600:
        problems.append(f"socket {oct(mode(d.socket_path))}")
    if mode(d.socket_path.parent) != 0o700:
        problems.append(f"socket dir {oct(mode(d.socket_path.parent))}")
    if mode(d.data_dir) != 0o700:
        problems.append(f"data dir {oct(mode(d.data_dir))}")
    if mode(d.data_dir / "owner.token") != 0o600:
        problems.append(f"owner.token {oct(mode(d.data_dir / 'owner.token'))}")
    writable = [str(p) for p in iter_tree(d.data_dir) if not p.is_symlink() and mode(p) & 0o022]
    if writable:
        problems.append(f"group/other-writable: {writable[:5]}")
    for v in problems:
        tally.violation(f"permissions: {v}")
    assert not problems


def test_no_sample_text_or_token_in_logs_or_files(world, tally) -> None:
    d, a, b, _ids = world
    # Error paths that carry sample text must not echo it either.
    for s in (
        common_pb2.Sample(chat=common_pb2.Chat(messages=[common_pb2.ChatMessage(role=9, content=CANARY)])),
        common_pb2.Sample(text=CANARY * 3000),
    ):
        code, msg = code_of(lambda s=s: append(a, A_DS, [s]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and CANARY not in msg, (code, msg)
    leaks = [f"log line {i}: {ln[:160]}" for i, ln in enumerate(d.log_lines()) if CANARY in ln]
    tokens = [t for t in (a.token, b.token, d.owner_token) if t]
    leaks += [f"token in log line {i}" for i, ln in enumerate(d.log_lines()) if any(t in ln for t in tokens)]
    needle = CANARY.encode()
    for p in iter_tree(d.data_dir):
        skip = ("lorad.sqlite", "lorad.sqlite-wal", "lorad.sqlite-shm")
        if p.is_file() and p.name not in skip and needle in p.read_bytes():
            leaks.append(f"file {p.relative_to(d.data_dir)}")
    for v in leaks:
        tally.violation(f"sample text/token leak: {v}")
    tally.number("canary: log lines scanned", len(d.log_lines()))
    assert not leaks, leaks[:10]
