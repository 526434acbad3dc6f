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
    for needed in ("onnxruntime-qnn", "apscheduler", "structlog", "numpy"):
        assert any(r.startswith(needed) for r in server), needed


def test_no_bare_top_level_modules_are_importable(tmp_path: Path) -> None:
    code = "import importlib.util as u; print([n for n in ('client', 'server', 'kernels') if u.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sdk_import_pulls_in_no_compute_stack(tmp_path: Path) -> None:
    code = (
        "import sys, lorad.client, lorad.v1.jobs_pb2_grpc; "
        "bad = [m for m in ('torch', 'onnxruntime', 'numpy', 'lorad.server', 'lorad.kernels') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
