"""Backend detection: once per process, x86 simulator never auto-selected, overrides and fallback reasons."""

from __future__ import annotations

import pathlib
import platform

import pytest

from lorad.kernels import BACKENDS, BackendInfo, detect_backend
from lorad.kernels.capabilities import capability, cpu_bf16, cpu_int8


def test_auto_picks_a_backend_and_says_why() -> None:
    info = detect_backend()
    assert isinstance(info, BackendInfo) and info.name in BACKENDS and info.reason
    assert set(info.available) == set(BACKENDS)
    assert detect_backend("auto") == info  # cached probe, same answer


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-only rule")
def test_x86_simulator_is_not_auto_selected() -> None:
    info = detect_backend()
    # Without an NPU: torch bf16 where the CPU multiplies bf16 natively, else ORT's CPU EP; never the simulator.
    assert info.name == ("torch" if cpu_bf16().native else "ort-cpu")
    if info.available["qnn-htp"].startswith("simulator"):
        assert "simulator" in info.reason
    if cpu_bf16().native:
        assert "bf16" in info.reason


def test_cpu_bf16_detection_reads_this_cpu() -> None:
    flags = pathlib.Path("/proc/cpuinfo").read_text()
    native = any(f" {f}" in flags for f in ("avx512_bf16", "amx_bf16")) or " bf16" in flags
    assert cpu_bf16().native == native and cpu_bf16().reason


def test_planner_menu_offers_only_real_precisions() -> None:
    want = tuple(p for p, f in (("bf16", cpu_bf16), ("w8a8", cpu_int8)) if f().native)
    assert capability("torch").planner_menu() == want  # native here only; emulated precisions are never planned
    assert "fp16" not in capability("torch").planner_menu()
    assert capability("ort-cpu").planner_menu() == ("w8a8",)
    assert capability("qnn-htp").reference == "fp16"
    with pytest.raises(ValueError, match="tpu"):
        capability("tpu")


def test_override_is_honoured_or_falls_back_with_reason() -> None:
    info = detect_backend("torch")
    assert info.name == "torch" and "override" in info.reason
    qnn = detect_backend("qnn-htp")
    if detect_backend().available["qnn-htp"].startswith("unavailable"):
        assert qnn.name != "qnn-htp" and "unusable" in qnn.reason
    else:
        assert qnn.name == "qnn-htp" and qnn.soc_model and qnn.htp_arch


def test_unknown_override_rejected() -> None:
    with pytest.raises(ValueError, match="gpu"):
        detect_backend("gpu")


def test_the_provider_probe_runs_in_its_own_process() -> None:
    """Asking which backend to use loads neither onnxruntime nor the QNN libraries into the asking process (the
    daemon trains on torch without them), yet reports what loads: the probe ran in a child (kernels/ep_probe.py)."""
    import subprocess
    import sys

    code = (
        "import sys; from lorad.kernels import detect_backend; info = detect_backend(); "
        "maps = open('/proc/self/maps').read(); "
        "print(info.available['ort-cpu'], 'onnxruntime' in sys.modules, 'libonnxruntime' in maps)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines()[-1].split() == ["ok", "False", "False"], out.stdout + out.stderr[-2000:]


def test_a_failing_probe_process_leaves_torch_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorad.kernels import detect

    monkeypatch.setattr(detect, "_probe", None)
    monkeypatch.setattr(detect.sys, "executable", "/bin/false")  # the child exits 1 without a word
    info = detect_backend()
    assert info.name == "torch"
    for backend in ("ort-cpu", "qnn-htp"):
        assert info.available[backend].startswith("unavailable: the provider probe process failed"), info.available
    assert "probe process failed" in info.reason
