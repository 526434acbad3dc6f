"""The engine facade: every name it lists is the engine's own object, typed and lazily imported."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from lorad.server.engine import api

SOURCE = Path(api.__file__).read_text()


def _type_checking_imports() -> dict[str, tuple[str, str]]:
    """facade name -> (module, name) as the ``if TYPE_CHECKING:`` block imports it (what mypy sees)."""
    block = next(n for n in ast.parse(SOURCE).body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {
        a.asname or a.name: (node.module or "", a.name)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }


def test_the_typed_names_and_the_lazy_names_are_the_same() -> None:
    assert _type_checking_imports() == api._LAZY
    assert set(api.__all__) == {*api._LAZY, "warm_up"}
    assert len(api.__all__) == len(set(api.__all__))


def test_every_name_is_the_engine_object_it_names() -> None:
    for name, (module, attr) in api._LAZY.items():
        assert getattr(api, name) is getattr(importlib.import_module(module), attr), name


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(api, "no_such_name")  # a name the facade does not list


def test_importing_the_facade_imports_no_engine_module(tmp_path: Path) -> None:
    code = (
        "import sys, lorad.server.engine.api as api; "
        "before = sorted(m for m in sys.modules if m == 'torch' or m.startswith('lorad.server.engine.') "
        "and m != 'lorad.server.engine.api'); "
        "api.prepare_main; "  # `lorad prepare` (and --list-socs) stays torch-free through the facade
        "print(before, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False"
