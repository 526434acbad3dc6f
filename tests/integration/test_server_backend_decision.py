"""One backend decision per daemon: status, CreateJob's precision check, the job runner and the session agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from lorad.kernels.capabilities import PRECISIONS, capability
from lorad.server.jobs.session import SessionRequest
from lorad.server.rpc.convert import BACKEND_ENUMS, BACKEND_NAMES, PRECISION_ENUMS
from lorad.v1 import device_pb2, jobs_pb2
from tests.integration.helpers import append, code_of, tiny_config

pytestmark = pytest.mark.integration
# Not charging: jobs stay WAITING, so nothing trains while the test asks the runner.
UNPLUGGED = {"battery_percent": 90, "charging": False, "temperature_celsius": 30.0, "idle": True}


def _bundle_for(model: Path, root: Path) -> None:
    """A well-formed bundle manifest for ``model`` on this host's QNN target (the x86 simulator's SoC)."""
    from lorad.kernels.detect import qnn_target
    from lorad.server.engine.prepare import model_hash_of_folder
    from lorad.server.engine.prepare.build import versions
    from lorad.server.engine.prepare.manifest import GraphEntry, Manifest, ResolvedPlan, sha256_file, write_manifest

    (root / "contexts").mkdir(parents=True)
    f = root / "contexts/a_ctx.onnx"
    f.write_bytes(b"graph bytes")
    soc, arch = qnn_target()
    write_manifest(root, Manifest(
        model_hash=model_hash_of_folder(model), model_name="tiny", model_arch="llama", soc_chip="SIM",
        soc_name="simulator", soc_model=soc, htp_arch=arch, buckets=(32,),
        plan=ResolvedPlan({"lm_head": ("fp16", "fp16")}),
        graphs=(GraphEntry("lm_head", "fwd", 32, "fp16", "contexts/a_ctx.onnx", f.stat().st_size, sha256_file(f)),),
        created_at="2026-01-01T00:00:00+00:00", host="x86_64", **versions(),
    ))  # fmt: skip


def _status_backend(d: Any) -> tuple[str, str]:
    owner = d.owner()
    st = owner.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=owner.md)
    return BACKEND_NAMES[st.backend.backend], st.backend.reason


def _create(app: Any, rid: str, backend: str, precision: str) -> Any:
    cfg = tiny_config(precision=PRECISION_ENUMS.get(precision, 0), backend=BACKEND_ENUMS.get(backend, 0))
    req = jobs_pb2.CreateJobRequest(request_id=rid, dataset_ids=["notes"], config=cfg)
    return app.jobs.CreateJob(req, metadata=app.md).job


@pytest.mark.parametrize(
    ("training", "expected"),
    [
        ({"backend": "torch"}, "torch"),
        ({"backend": "ort-cpu"}, "ort-cpu"),
        ({"backend": "auto"}, None),  # whatever this host's probe picks, as long as every part says the same
        ({"backend": "auto", "qnn_bundle": "BUNDLE"}, "qnn-htp"),  # a bundle runs on the HTP, not the probe's pick
    ],
    ids=["torch", "ort-cpu", "auto", "qnn-bundle"],
)
def test_status_create_job_and_runner_agree(make_daemon, tmp_path: Path, tiny_llama: Path,
                                            training: dict[str, Any], expected: str | None) -> None:  # fmt: skip
    from lorad.kernels import detect_backend

    if training.get("qnn_bundle"):
        if detect_backend("qnn-htp").name != "qnn-htp":
            pytest.skip("the QNN HTP EP (or its simulator) is not loadable here")
        _bundle_for(tiny_llama, tmp_path / "bundle")
        training = {**training, "qnn_bundle": str(tmp_path / "bundle")}
    d = make_daemon(training=training, probe_values=UNPLUGGED, require_charging=True)
    name, reason = _status_backend(d)
    assert expected is None or name == expected, (name, reason)
    s = d.daemon.services
    assert (s.backend.name, s.backend.reason) == (name, reason)

    app, _ = d.register("notes", max_active_jobs=20)
    append(app)
    runs = capability(name).precisions
    for i, p in enumerate(PRECISIONS):
        if p not in PRECISION_ENUMS:
            continue  # a kernel precision the API does not offer (yet)
        if p in runs:
            assert _create(app, f"p{i}", "auto", p).job_id, p
        else:
            code, msg, trailing = code_of(lambda p=p, i=i: _create(app, f"p{i}", "auto", p))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and trailing["lorad-error-field"] == "config.precision"
            assert f"backend {name}" in msg, msg

    job = _create(app, "auto-job", "auto", "auto")
    stored = s.jobs.get(job.job_id)
    assert s.runner.backend_for is not None
    assert s.runner.backend_for(stored) == (name, reason), "the runner's start event names the status backend"
    session = s.runner.factory(SessionRequest(job.job_id, "notes", stored.spec, (), tmp_path / "w"))
    assert (session.backend.name, session.backend.reason) == (name, reason), "the session trains on it"

    # A job that names its own backend gets it, and its precision is checked against that backend.
    other = "torch" if name != "torch" else "ort-cpu"
    extra = [p for p in capability(other).precisions if p not in runs and p in PRECISION_ENUMS]
    precision = extra[0] if extra else capability(other).reference  # one the daemon's backend would refuse, if any
    job = _create(app, "own-job", other, precision)
    stored = s.jobs.get(job.job_id)
    assert s.runner.backend_for(stored)[0] == other
    assert s.runner.factory(SessionRequest(job.job_id, "notes", stored.spec, (), tmp_path / "w2")).backend.name == other


def test_status_says_whether_the_cpu_kernels_run_and_only_the_owner_sees_where(make_daemon) -> None:
    from lorad.kernels import fused

    d = make_daemon()
    ops = fused.kernels()  # the daemon runs in this process: its models decide the same way
    owner = d.owner()
    st = owner.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=owner.md).backend.cpu_kernels
    assert st.active is (ops is not None)
    assert st.detail == fused.describe()[1]
    assert ("lorad_fused-" in st.detail) if ops is not None else ("torch ops run instead" in st.detail)
    app, _ = d.register("notes")
    st = app.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=app.md).backend.cpu_kernels
    assert st.active is (ops is not None) and st.detail == ""  # the detail names paths on the device


def test_an_unreadable_model_is_named_to_the_owner_and_only_called_not_readable_to_an_app(
    make_daemon, tmp_path: Path
) -> None:
    import time

    from lorad.server.modelhost import UNREADABLE

    broken = tmp_path / "broken-model"
    broken.mkdir()  # a folder that is not a model: its error names the device path
    d = make_daemon(training={"model_dirs": [str(broken)]})
    owner = d.owner()
    app, _ = d.register("notes")

    def detail(who: Any) -> str:
        for _ in range(200):
            st = who.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=who.md)
            m = next(m for m in st.models if m.name == "broken-model")
            if not m.detail.startswith("reading"):
                return m.detail
            time.sleep(0.05)
        raise AssertionError("the broken model is still being read")

    got = detail(owner)
    assert got.startswith(f"{UNREADABLE}: FileNotFoundError") and str(broken) in got, got
    assert detail(app) == UNREADABLE
