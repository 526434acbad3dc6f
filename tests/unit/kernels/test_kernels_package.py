"""The kernels package: every name it lists is its module's own object, typed, and imported on first use."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import lorad.kernels as kernels


def test_the_typed_names_and_the_lazy_names_are_the_same() -> None:
    tree = ast.parse(Path(kernels.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    typed = {
        a.asname or a.name: (n.module, a.name) for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names
    }
    assert typed == kernels._LAZY
    assert sorted(kernels.__all__) == sorted(kernels._LAZY)


def test_every_name_is_the_module_object_it_names() -> None:
    for name, (module, attr) in kernels._LAZY.items():
        assert getattr(kernels, name) is getattr(importlib.import_module(module), attr), name


def test_importing_the_package_or_a_capability_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys, lorad.kernels, lorad.server.engine.training.config; "
        "from lorad.kernels import capabilities; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_unknown_name_is_an_attribute_error_and_submodules_still_import() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(kernels, "no_such_name")  # a name the package does not list
    from lorad.kernels import ep_probe

    assert ep_probe.__name__ == "lorad.kernels.ep_probe"
