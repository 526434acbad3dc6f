"""Property-based fuzzing of every RPC's request fields: only documented codes, daemon stays up, nothing stored."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorad.v1 import common_pb2, jobs_pb2
from tests.reliability.harness import BAD, SubprocessDaemon, append, corpus, create_job, diff_snapshots, store_snapshot
from tests.reliability.rpcs import DOCUMENTED, Rpc, all_rpcs, call_raw

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

EXAMPLES_PER_RPC = 60  # 28 RPCs → 1,680 structured cases, plus the oversized and raw-bytes cases below
BAD_UTF8_MARK = "@@BADUTF8@@"  # replaced in the wire bytes by as many invalid UTF-8 bytes (lengths stay valid)
DESTRUCTIVE = {
    "DeleteDataset",
    "CancelJob",
    "DeleteSchedule",
    "DeleteAdapter",
    "ForgetApp",
    "RevokeApp",
    "RotateAppToken",
}
INT_EDGES = [0, 1, -1, 2, 7, 63, 64, 65, 100, 128, 1000, 1001, 4096, 65_536, 100_001, 2**31 - 1, -(2**31), 2**32 - 1,
             2**63 - 1, -(2**63), 2**64 - 1]  # fmt: skip
RANGES = {F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
          F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1),
          F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_FIXED64: (0, 2**64 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
          F.TYPE_SFIXED64: (-(2**63), 2**63 - 1)}  # fmt: skip


class Pool:
    """Identifiers that exist (so fuzzed requests reach deep code) plus hostile ones."""

    real: ClassVar[list[str]] = []
    protected: ClassVar[set[str]] = set()


def _strings() -> st.SearchStrategy[str]:
    hostile = ["", " ", "\x00", "../..", "a/b", "..", "\u202e", "\ud7ff", "💥" * 20, "a" * 129, "a" * 65,
               "x" * 65_537, "y" * 300_000, "30 2 * * *", "* * * * * *", "Europe/Berlin", "Mars/Olympus",
               "q_proj", "torch", "smollm2-135m-instruct", "llama", "%s%n", "'; DROP TABLE samples;--",
               BAD_UTF8_MARK, f"ok-{BAD_UTF8_MARK}"]  # fmt: skip
    return st.one_of(
        st.sampled_from(hostile),
        st.sampled_from(Pool.real) if Pool.real else st.just("ds1"),
        st.text(max_size=40),
        st.text(alphabet=st.characters(max_codepoint=0x1F), max_size=20),
        st.from_regex(r"[a-z0-9][a-z0-9._-]{0,70}", fullmatch=True),
    )


def _scalar(f: Any) -> st.SearchStrategy[Any]:
    t = f.type
    if t == F.TYPE_STRING:
        return _strings()
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_ENUM:
        return st.integers(-3, 12)  # proto3 enums are open: unknown values reach the server as ints
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-9, 3.0e38, -3.0e38, 80.0, 81.0]),
                         st.floats(width=32))  # NaN and ±inf included  # fmt: skip
    lo, hi = RANGES[t]
    return st.one_of(st.sampled_from([v for v in INT_EDGES if lo <= v <= hi]), st.integers(lo, hi))


@st.composite
def message(draw: st.DrawFn, desc: Any, depth: int = 0) -> Any:
    """A message of ``desc`` with a random subset of fields set to adversarial values (unset = missing)."""
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(desc)()
    for f in desc.fields:
        if not draw(st.booleans()):
            continue  # missing field
        if f.type == F.TYPE_MESSAGE:
            if depth >= 3:
                continue
            n = draw(st.integers(0, 3)) if f.is_repeated else 1
            for _ in range(n):
                sub = draw(message(f.message_type, depth + 1))
                (getattr(msg, f.name).add().CopyFrom(sub) if f.is_repeated
                 else getattr(msg, f.name).CopyFrom(sub))  # fmt: skip
        elif f.is_repeated:
            getattr(msg, f.name).extend(draw(st.lists(_scalar(f), max_size=4)))
        else:
            setattr(msg, f.name, draw(_scalar(f)))
    return msg


def _wire(msg: Any) -> bytes:
    raw = msg.SerializeToString()
    mark = BAD_UTF8_MARK.encode()
    return raw.replace(mark, b"\xff\xfe\xc3\x28\xa0\xa1\xe2\x28\xa1\xf0\x90")  # 11 invalid UTF-8 bytes


@st.composite
def payload(draw: st.DrawFn, rpc: Rpc) -> bytes:
    """Serialized request bytes: a fuzzed message, sometimes with wrong-wire-type fields or garbage appended."""
    raw = _wire(draw(message(rpc.request.DESCRIPTOR)))
    mode = draw(st.integers(0, 9))
    if mode == 0:  # a field sent with the wrong wire type (e.g. a varint where a string is declared)
        nums = [f.number for f in rpc.request.DESCRIPTOR.fields] or [1]
        num = draw(st.sampled_from(nums))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        body = {0: b"\x96\x01", 1: b"\x00" * 8, 2: b"\x03abc", 5: b"\x00" * 4}[wire]
        raw += bytes([(num << 3) | wire]) + body if num < 16 else b""
    elif mode == 1:  # random bytes: truncated / malformed protobuf
        raw = draw(st.binary(min_size=1, max_size=48))
    return raw


def _md_for(rpc: Rpc, d: SubprocessDaemon, app_md: tuple, draw: Any) -> tuple:
    if rpc.path.startswith("/lorad.v1.AppService/"):
        return (("authorization", f"Bearer {d.owner_token}"),)
    if rpc.name == "ForgetApp" and draw(st.booleans()):
        return (("authorization", f"Bearer {d.owner_token}"),)
    return app_md


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    """A daemon whose device conditions never allow training (fuzzed jobs park in WAITING)."""
    d = SubprocessDaemon(tmp_path_factory.mktemp("fuzz"), tiny_llama, probe=BAD)
    d.start()
    app = d.register("fz")
    append(app, "ds1", corpus(6))
    job = create_job(app, "r1", ("ds1",), steps=4)
    sched = app.jobs.CreateSchedule(
        jobs_pb2.CreateScheduleRequest(dataset_ids=["ds1"], window=common_pb2.TrainingWindow(cron="30 2 * * *")),
        metadata=app.md,
    ).schedule
    Pool.real = ["fz", "ds1", job.job_id, sched.schedule_id, "r1"]
    Pool.protected = set(Pool.real)
    state = {"snap": store_snapshot(d.data_dir)}
    yield d, app, state
    assert d.stop() == 0


RPCS = all_rpcs()
CODES: Counter[str] = Counter()


@pytest.mark.parametrize("rpc", RPCS, ids=[r.name for r in RPCS])
def test_fuzz_rpc(target, rpc: Rpc, tally) -> None:
    d, app, state = target
    ch = app.channel

    @settings(max_examples=EXAMPLES_PER_RPC, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(data=st.data())
    def case(data: st.DataObject) -> None:
        if rpc.client_streaming:
            items = data.draw(st.lists(payload(rpc), min_size=0, max_size=4))
        else:
            items = data.draw(payload(rpc))
        if rpc.name in DESTRUCTIVE:
            blob = b"".join(items) if isinstance(items, list) else items
            if not blob or any(p.encode() in blob for p in Pool.protected):
                return  # never delete the fixtures the other cases need (and "" = ForgetApp of oneself)
        md = _md_for(rpc, d, app.md, data.draw)
        timeout = 1.0 if rpc.name == "WatchJob" else 30.0
        code, msg, _ = call_raw(ch, rpc, items, md, timeout=timeout)
        tally.fuzz()
        CODES[code.name] += 1
        tally.number("fuzz: status codes seen", dict(CODES.most_common()))
        allowed = DOCUMENTED | ({grpc.StatusCode.DEADLINE_EXCEEDED} if rpc.name == "WatchJob" else set())
        problems = []
        if code not in allowed:
            problems.append(f"{rpc.name}: undocumented {code.name} {msg[:200]!r}")
        if not (d.alive() and app.healthy(5)):
            problems.append(f"{rpc.name}: daemon not healthy after the call")
        snap = store_snapshot(d.data_dir)
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED) and rpc.name != "StreamSamples":
            # (a StreamSamples failure keeps the committed prefix by design)
            changed = diff_snapshots(state["snap"], snap)
            if changed:
                problems.append(f"{rpc.name}: refused with {code.name} but the store changed: {changed[:2]}")
        state["snap"] = snap
        for p in problems:
            tally.violation(f"fuzz: {p}")
        assert not problems, problems

    case()


def test_oversized_messages_and_streams(target, tally) -> None:
    """A message above the 17 MiB limit → RESOURCE_EXHAUSTED; a long stream of bad batches → INVALID_ARGUMENT."""
    d, app, state = target
    by_name = {r.name: r for r in RPCS}
    huge = common_pb2.Sample(text="z" * (18 << 20))
    from lorad.v1 import data_pb2

    req = data_pb2.AppendSamplesRequest(dataset_id="ds1", samples=[huge]).SerializeToString()
    problems = []
    for name in ("AppendSamples", "CreateJob", "Generate", "StreamSamples"):
        code, msg, _ = call_raw(app.channel, by_name[name], req, app.md, timeout=60)
        tally.fuzz()
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            problems.append(f"{name} with an 18 MiB message → {code.name} {msg[:120]!r}")
    # 1,001 samples in one call (limit 1,000), and a 400-message stream whose messages are all invalid.
    many = data_pb2.AppendSamplesRequest(
        dataset_id="ds1", samples=[common_pb2.Sample(text=f"s{i}") for i in range(1001)]
    ).SerializeToString()
    code, msg, _ = call_raw(app.channel, by_name["AppendSamples"], many, app.md)
    tally.fuzz()
    if code != grpc.StatusCode.INVALID_ARGUMENT:
        problems.append(f"AppendSamples with 1,001 samples → {code.name}")
    bad_msg = data_pb2.StreamSamplesRequest(dataset_id="ds1", samples=[common_pb2.Sample()]).SerializeToString()
    code, msg, _ = call_raw(app.channel, by_name["StreamSamples"], [bad_msg] * 400, app.md, timeout=60)
    tally.fuzz()
    if code != grpc.StatusCode.INVALID_ARGUMENT:
        problems.append(f"StreamSamples with 400 invalid messages → {code.name}")
    if not app.healthy(5):
        problems.append("daemon unhealthy after oversized input")
    snap = store_snapshot(d.data_dir)
    changed = diff_snapshots(state["snap"], snap)
    if changed:
        problems.append(f"oversized/invalid input changed the store: {changed[:2]}")
    state["snap"] = snap
    for p in problems:
        tally.violation(f"fuzz: {p}")
    assert not problems, problems
