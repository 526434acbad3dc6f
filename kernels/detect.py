"""Backend detection, once per process: QNN HTP on a real NPU, else torch bf16 on a CPU with native bf16, else the
ONNX Runtime CPU EP, else torch fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from lorad.kernels import ep_probe
from lorad.kernels.capabilities import BACKENDS, cpu_bf16

log = structlog.get_logger(__name__)

# QNN SoC defaults for the x86 HTP simulator (docs/qnn_htp.md §0: "60"/"73" measured; perf options are no-ops).
SIM_SOC_MODEL = "60"
SIM_HTP_ARCH = "73"
# /sys/devices/soc0/soc_id -> (QNN soc_model, htp_arch) for Snapdragon parts we know; override with
# LORAD_QNN_SOC_MODEL / LORAD_QNN_HTP_ARCH for anything else.
_KNOWN_SOCS: dict[str, tuple[str, str]] = {
    "519": ("43", "73"),  # SM8550 (8 Gen 2)
    "557": ("57", "75"),  # SM8650 (8 Gen 3)
    "618": ("69", "79"),  # SM8750 (8 Elite)
}


@dataclass(frozen=True)
class BackendInfo:
    """The chosen backend and why.

    Attributes:
        name: one of BACKENDS.
        reason: why it was chosen, or why a preferred backend was not (the fallback reason).
        soc_model: QNN ``soc_model`` provider option ("" when QNN is not usable).
        htp_arch: QNN ``htp_arch`` provider option ("" when QNN is not usable).
        available: backend -> short status ("ok", "simulator", or the load error).
    """

    name: str
    reason: str
    soc_model: str = ""
    htp_arch: str = ""
    available: dict[str, str] = field(default_factory=dict)


_PROBE_TIMEOUT_S = 120.0  # a phone loading the QNN libraries cold; seconds on x86
_lock = threading.Lock()
_probe: dict[str, Any] | None = None
_qnn_devices: list[Any] | None = None


def qnn_ep_devices() -> list[Any]:
    """Register the QNN plugin EP in this process once and return its OrtEpDevice list (raises if it cannot load)."""
    global _qnn_devices
    with _lock:
        if _qnn_devices is None:
            _qnn_devices = ep_probe.qnn_devices()
        return _qnn_devices


def _soc() -> tuple[str, str]:
    env_soc, env_arch = os.environ.get("LORAD_QNN_SOC_MODEL"), os.environ.get("LORAD_QNN_HTP_ARCH")
    try:
        soc_id = Path("/sys/devices/soc0/soc_id").read_text().strip()
    except OSError:
        soc_id = ""
    known = _KNOWN_SOCS.get(soc_id, (SIM_SOC_MODEL, SIM_HTP_ARCH))
    return env_soc or known[0], env_arch or known[1]


def qnn_target() -> tuple[str, str]:
    """(soc_model, htp_arch) the QNN sessions of this process are built for (env override, known SoC, simulator)."""
    return _soc()


def _run_probe() -> dict[str, Any]:
    """``ep_probe.probe()`` run in a child process (see there why), plus the QNN target where QNN loads."""
    cmd = [sys.executable, "-P", ep_probe.__file__]  # -P: the script's folder (kernels/, with queue.py) not on sys.path
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=True)
        found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        tail = exc.stderr.strip()[-300:] if isinstance(exc, subprocess.CalledProcessError) and exc.stderr else ""
        why = f"unavailable: the provider probe process failed ({type(exc).__name__}: {exc}) {tail}".strip()
        found = {"available": {"torch": "ok", "ort-cpu": why, "qnn-htp": why}, "real_npu": False}
    soc, arch = ("", "") if found["available"]["qnn-htp"].startswith("unavailable") else _soc()
    return {**found, "soc_model": soc, "htp_arch": arch}


def detect_backend(override: str | None = None) -> BackendInfo:
    """Pick the backend for this process (the hardware probe runs once and is cached).

    Args:
        override: None or "auto" to choose automatically, else a name from BACKENDS (config override). The
            override is honoured if that backend can load, otherwise the auto choice is returned with the reason.

    Returns:
        BackendInfo; ``reason`` says why, including any fallback.

    Raises:
        ValueError: ``override`` is not "auto", None or a known backend.
    """
    global _probe
    if override not in (None, "auto", *BACKENDS):
        raise ValueError(f"unknown backend override {override!r}; choose 'auto' or one of {BACKENDS}")
    with _lock:
        probe_needed = _probe is None
    if probe_needed:
        p = _run_probe()
        with _lock:
            _probe = _probe or p
    assert _probe is not None
    avail: dict[str, str] = dict(_probe["available"])
    soc, arch = _probe["soc_model"], _probe["htp_arch"]
    qnn_ok = not avail["qnn-htp"].startswith("unavailable")
    cpu_ok = avail["ort-cpu"] == "ok"
    prefix = ""
    if override not in (None, "auto"):
        status = avail.get(override, "")
        if not status.startswith("unavailable"):
            info = BackendInfo(override, f"config override ({status})", soc, arch, avail)
            log.info("backend_selected", backend=info.name, reason=info.reason)
            return info
        prefix = f"override {override!r} unusable ({status}); "
    bf16 = cpu_bf16()
    if qnn_ok and _probe["real_npu"]:
        info = BackendInfo("qnn-htp", prefix + "QNN HTP EP loaded on a real NPU device", soc, arch, avail)
    elif bf16.native:
        # Measured on a 2-core Zen 5 (bench/kernels.py): all SmolLM2 frozen products fwd+bwd at 256 tokens take
        # ~210 ms in torch bf16 (oneDNN) vs ~420 ms on the ORT CPU EP in fp32, and ORT has no bf16 GEMM on x86.
        npu = f"no NPU (QNN HTP EP {avail['qnn-htp']})" if not qnn_ok else "QNN HTP only as the x86 simulator"
        why = f"{npu}; {bf16.reason}: torch bf16 (oneDNN) is the fastest engine for the frozen products"
        info = BackendInfo("torch", prefix + why, soc, arch, avail)
    elif cpu_ok:
        why = (
            "QNN HTP EP loads but only as the x86 simulator (~100x slower than the CPU EP); using ORT CPU EP"
            if qnn_ok
            else f"QNN HTP EP {avail['qnn-htp']}; using ORT CPU EP"
        )
        info = BackendInfo("ort-cpu", prefix + why, soc, arch, avail)
    else:
        info = BackendInfo("torch", prefix + f"onnxruntime {avail['ort-cpu']}; using torch reference", "", "", avail)
    log.info("backend_selected", backend=info.name, reason=info.reason)
    return info
