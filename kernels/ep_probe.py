"""Which ONNX Runtime execution providers load here: run by ``detect.py`` as a process of its own.

In its own process because loading the providers maps onnxruntime and the QNN libraries (~20 MB of RSS on x86, the
HTP simulator's among them) into whatever process asks, for good, and a vendor library that crashes while it loads
would take that process down with it. The daemon asks once at start and trains on torch unless a job needs ONNX
Runtime, so it now idles and trains without them. Run as a script (``python -P ep_probe.py``: nothing from lorad, so
no torch either); prints one JSON object.
"""

from __future__ import annotations

import json
import platform
from typing import Any


def qnn_devices() -> list[Any]:
    """Registers the QNN plugin EP in this process and returns its OrtEpDevices (raises if it cannot load)."""
    import onnxruntime as ort
    import onnxruntime_qnn as oq

    ort.register_execution_provider_library("QNNExecutionProvider", oq.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devices:
        raise RuntimeError("QNNExecutionProvider registered but reports no devices")
    return devices


def probe() -> dict[str, Any]:
    """``{"available": {backend: "ok" | "simulator (arch)" | "unavailable: why"}, "real_npu": bool}``."""
    avail: dict[str, str] = {"torch": "ok"}
    try:
        import onnxruntime  # noqa: F401

        avail["ort-cpu"] = "ok"
    except Exception as exc:  # any import failure means the backend is unusable
        avail["ort-cpu"] = f"unavailable: {type(exc).__name__}: {exc}"
    real_npu = False
    try:
        real_npu = any(str(d.device.type).endswith("NPU") for d in qnn_devices())
        avail["qnn-htp"] = "ok" if real_npu else f"simulator ({platform.machine()})"
    except Exception as exc:
        avail["qnn-htp"] = f"unavailable: {type(exc).__name__}: {exc}"
    return {"available": avail, "real_npu": real_npu}


if __name__ == "__main__":
    print(json.dumps(probe()))
