"""Packaging: one `lorad` import root, SDK-only base install, daemon deps behind the server extra."""

import email
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("lorad-*.whl")
    return found


def test_wheel_installs_only_the_lorad_root(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"lorad", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for pkg in ("client", "server", "kernels", "v1"):
        assert f"lorad/{pkg}/__init__.py" in names, pkg
    assert "lorad/v1/jobs_pb2.pyi" in names  # typed stubs ship with the generated code
    assert "lorad/client/demo_data/mara.jsonl" in names  # the demo runs from a plain install too


def test_base_install_is_the_sdk_only(wheel: Path) -> None:
    meta = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA")))
    requires = email.message_from_bytes(meta).get_all("Requires-Dist") or []
    base = [r for r in requires if "extra ==" not in r]
    server = [r for r in requires if 'extra == "server"' in r]
    assert sorted(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in base) == ["grpcio", "protobuf"], base
    assert any(r.startswith("torch==2.13.0") for r in server), server
    # Every torch requirement is an exact pin; aarch64 has its own (PyPI's aarch64 torch 2.13.0 is a CUDA build).
    torch = [r for r in server if r.startswith("torch")]
    assert all(r.startswith("torch==") for r in torch), torch
    assert any(r.startswith("torch==2.10.0") and 'platform_machine == "aarch64"' in r for r in torch), torch
    for needed in ("onnxruntime-qnn", "apscheduler", "structlog", "numpy"):
        assert any(r.startswith(needed) for r in server), needed


def test_no_bare_top_level_modules_are_importable(tmp_path: Path) -> None:
    code = "import importlib.util as u; print([n for n in ('client', 'server', 'kernels') if u.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sdk_import_pulls_in_no_compute_stack(tmp_path: Path) -> None:
    code = (
        "import sys, lorad.client, lorad.client.cli, lorad.v1.jobs_pb2_grpc; "
        "bad = [m for m in ('torch', 'onnxruntime', 'numpy', 'flwr', 'lorad.server', 'lorad.kernels', "
        "'lorad.client.federated') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _lower_bound(requires: list[str], name: str) -> tuple[int, ...]:
    (req,) = [r for r in requires if re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] == name and "extra ==" not in r]
    found = re.search(r">=\s*([0-9.]+)", req)
    assert found, req
    return tuple(int(p) for p in found.group(1).split("."))


def test_generated_code_runs_with_the_federated_extra(wheel: Path) -> None:
    """The base ranges admit the generated code's runtime, and protobuf 6 (flwr caps protobuf < 7) stays allowed."""
    meta = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA")))
    requires = email.message_from_bytes(meta).get_all("Requires-Dist") or []
    gen_dir = ROOT / "proto" / "lorad" / "v1"
    stamps = {
        tuple(int(x) for x in m.groups())
        for f in gen_dir.glob("*_pb2.py")
        for m in [re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", f.read_text())]
        if m
    }
    (gencode,) = stamps  # one protoc made every file
    assert _lower_bound(requires, "protobuf") == gencode  # runtime must be >= gencode; no tighter than needed
    assert gencode[0] == 6, "flwr (the federated extra) needs protobuf < 7: generate with a protobuf-6 protoc"
    grpc_stamps = {re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", f.read_text()) for f in gen_dir.glob("*_grpc.py")}
    (grpc_gen,) = {tuple(int(p) for p in m.group(1).split(".")) for m in grpc_stamps if m}
    assert _lower_bound(requires, "grpcio") == grpc_gen
    federated = [r for r in requires if 'extra == "federated"' in r]
    assert any(r.startswith("flwr==") for r in federated), federated
