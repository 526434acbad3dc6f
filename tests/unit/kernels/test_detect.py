"""Backend detection: once per process, x86 simulator never auto-selected, overrides and fallback reasons."""

from __future__ import annotations

import platform

import pytest

from lorad.kernels import BACKENDS, BackendInfo, detect_backend


def test_auto_picks_a_backend_and_says_why() -> None:
    info = detect_backend()
    assert isinstance(info, BackendInfo) and info.name in BACKENDS and info.reason
    assert set(info.available) == set(BACKENDS)
    assert detect_backend("auto") == info  # cached probe, same answer


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-only rule")
def test_x86_simulator_is_not_auto_selected() -> None:
    info = detect_backend()
    assert info.name == "ort-cpu"
    if info.available["qnn-htp"].startswith("simulator"):
        assert "simulator" in info.reason


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
