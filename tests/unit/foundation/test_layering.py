"""Layering rules read from the source: the engine only through its facade, the store only through the domain layer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
REPOS = ("apps", "samples", "jobs", "adapters", "schedules", "db")


ENGINE = "lorad.server.engine"
FACADE = f"{ENGINE}.api"
# lorad's top-level folders -> their import names (pyproject's package-dir)
PACKAGES = {"server": "lorad.server", "client": "lorad.client", "kernels": "lorad.kernels", "bench": "bench"}
# a dotted module path as a whole string constant, e.g. importlib.import_module("lorad.server.engine.prepare")
MODULE_STRING = re.compile(r"lorad(\.\w+)+")


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    return ".".join(p for p in parts if p != "__init__")


def _imports(path: Path) -> set[str]:
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path).rpartition(".")[0]
    return _imports_of(path.read_text(), package)


def _imports_of(source: str, package: str) -> set[str]:
    """Every module ``source`` imports (relative imports made absolute; ``from a import b`` counts as ``a.b`` too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if base == ENGINE)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.fullmatch(node.value):
            names.add(node.value)
    return names


def _outside_engine() -> list[Path]:
    files = [p for top in ("server", "bench", "client") for p in (ROOT / top).rglob("*.py")]
    return [p for p in files if ROOT / "server/engine" not in p.parents]


def test_outside_the_engine_only_the_facade_is_imported() -> None:
    bad = {
        str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.startswith(f"{ENGINE}.") and m != FACADE)
        for p in _outside_engine()
    }
    assert not {k: v for k, v in bad.items() if v}, f"import these through {FACADE}: {bad}"


def _deep(source: str, package: str = "lorad.server") -> set[str]:
    return {m for m in _imports_of(source, package) if m.startswith(f"{ENGINE}.") and m != FACADE}


def test_the_layering_check_sees_deep_imports() -> None:
    # The rule above must be able to fail: each form of reaching into the engine is seen, the facade is not.
    for src in (
        "from lorad.server.engine.models.loader import resolve",
        "from lorad.server.engine import training",
        "import lorad.server.engine.training.recipe",
        "from .engine.adapters import load_adapter",
        "importlib.import_module('lorad.server.engine.prepare')",
    ):
        assert _deep(src), src
    assert _deep("from ..engine.models import KVCache", "lorad.server.jobs")
    assert not _deep("from lorad.server.engine.api import resolve\nfrom lorad.server.engine import api\n")


def test_the_engine_never_imports_the_daemon() -> None:
    bad = {
        str(p.relative_to(ROOT)): sorted(
            m for m in _imports(p) if m.startswith("lorad.server") and not m.startswith(ENGINE)
        )
        for p in (ROOT / "server/engine").rglob("*.py")
    }
    assert not {k: v for k, v in bad.items() if v}, bad


def test_servicers_do_not_import_the_store() -> None:
    bad = {
        p.name: sorted(m for m in _imports(p) if m.startswith("lorad.server.store"))
        for p in (ROOT / "server/rpc").glob("*.py")
    }
    assert not {k: v for k, v in bad.items() if v}, bad


def test_servicers_call_no_repository() -> None:
    # The Services locator still holds the repositories for the daemon's own parts; servicers use the domain layer.
    call = re.compile(rf"\bself\.s\.(?:{'|'.join(REPOS)})\.(?!path\b)\w+")
    hits = [
        f"{p.name}:{i}"
        for p in (ROOT / "server/rpc").glob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if call.search(line)
    ]
    assert not hits, hits


def test_no_test_edits_sys_path() -> None:
    hits = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("*.py")
        if "sys.path" in p.read_text() and p != Path(__file__).resolve()
    ]
    assert not hits, hits


def test_every_test_folder_is_a_package() -> None:
    missing = [
        str(d.relative_to(ROOT))
        for d in [ROOT / "tests", *(ROOT / "tests").rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").exists()
    ]
    assert not missing, missing
