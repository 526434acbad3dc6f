"""The lorad.v1 protos compile from proto/ alone and follow buf's STANDARD conventions."""

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

PROTO_DIR = Path(__file__).resolve().parents[3] / "proto"
PROTOS = sorted(p.relative_to(PROTO_DIR).as_posix() for p in (PROTO_DIR / "lorad" / "v1").glob("*.proto"))
# FileDescriptorProto field numbers used in SourceCodeInfo paths.
MESSAGE_TYPE, ENUM_TYPE, SERVICE = 4, 5, 6
FIELD, NESTED, ENUM_VALUE, METHOD = 2, 3, 2, 2


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[descriptor_pb2.FileDescriptorProto]:
    out = tmp_path_factory.mktemp("desc") / "set.pb"
    # Plain grpc_tools.protoc with proto/ as the only include root: no project code involved.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            *PROTOS,
        ],
        cwd=PROTO_DIR,
        check=True,
        capture_output=True,
    )
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return [f for f in fds.file if f.name.startswith("lorad/")]


def _comments(f: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {tuple(loc.path): loc.leading_comments.strip() for loc in f.source_code_info.location}


def test_all_files_share_the_package(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    assert len(files) == len(PROTOS) >= 6
    assert {f.package for f in files} == {"lorad.v1"}


def test_every_field_and_rpc_is_documented(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    missing = []
    for f in files:
        docs = _comments(f)
        for mi, msg in enumerate(f.message_type):
            for fi, field in enumerate(msg.field):
                if not docs.get((MESSAGE_TYPE, mi, FIELD, fi)):
                    missing.append(f"{msg.name}.{field.name}")
        for si, svc in enumerate(f.service):
            for ri, rpc in enumerate(svc.method):
                if not docs.get((SERVICE, si, METHOD, ri)):
                    missing.append(f"{svc.name}.{rpc.name}")
    assert not missing, f"undocumented: {missing}"


def test_enums_start_with_unspecified_zero(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    for f in files:
        for enum in f.enum_type:
            prefix = "".join("_" + c if c.isupper() else c for c in enum.name).lstrip("_").upper()
            first = enum.value[0]
            assert (first.name, first.number) == (f"{prefix}_UNSPECIFIED", 0), enum.name
            assert all(v.name.startswith(prefix + "_") for v in enum.value), enum.name


def test_each_rpc_has_its_own_request_and_response(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    seen: set[str] = set()
    for f in files:
        for svc in f.service:
            assert svc.name.endswith("Service"), svc.name
            for rpc in svc.method:
                assert rpc.input_type == f".lorad.v1.{rpc.name}Request", rpc.name
                assert rpc.output_type == f".lorad.v1.{rpc.name}Response", rpc.name
                assert rpc.input_type not in seen
                seen.add(rpc.input_type)


def test_job_states_are_the_documented_lifecycle(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    (jobs,) = [f for f in files if f.name == "lorad/v1/jobs.proto"]
    (state,) = [e for e in jobs.enum_type if e.name == "JobState"]
    names = [v.name.removeprefix("JOB_STATE_") for v in state.value]
    assert names == [
        "UNSPECIFIED",
        "QUEUED",
        "WAITING",
        "RUNNING",
        "PAUSING",
        "PAUSED",
        "SUCCEEDED",
        "FAILED",
        "CANCELLED",
    ]


def test_every_proto_names_its_java_and_go_packages(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    for f in files:
        o = f.options
        assert (o.java_package, o.java_multiple_files) == ("dev.lorad.v1", True), f.name
        assert o.go_package == "lorad.dev/api/gen/go/lorad/v1;loradv1", f.name
    # java_multiple_files: each message is a top-level class, so no message may share the file's outer class name.
    for f in files:
        outer = "".join(w.title() for w in Path(f.name).stem.split("_"))
        assert outer not in {m.name for m in f.message_type} | {e.name for e in f.enum_type}, f.name
