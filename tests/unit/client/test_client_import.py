"""`import lorad.client` must stay light: no torch, onnxruntime, numpy, daemon or kernels."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("torch", "onnxruntime", "numpy", "lorad.server", "lorad.kernels")


def test_import_pulls_in_no_heavy_modules() -> None:
    code = (
        "import sys, lorad.client, lorad.client.cli, lorad.client.demo;"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "", f"lorad.client imported {out.stdout.strip()}"


def test_public_api_has_no_protobuf_types() -> None:
    import dataclasses
    import typing

    import lorad.client as c

    for name in c.__all__:
        obj = getattr(c, name)
        assert "_pb2" not in getattr(obj, "__module__", ""), name
        if dataclasses.is_dataclass(obj):
            assert obj.__dataclass_params__.frozen, f"{name} is not frozen"  # type: ignore[attr-defined]
            for hint in typing.get_type_hints(obj).values():
                assert "_pb2" not in repr(hint), f"{name} exposes {hint}"
