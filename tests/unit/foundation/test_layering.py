"""Layering rules read from the source: servicers reach the store only through the domain layer; tests are a package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
REPOS = ("apps", "samples", "jobs", "adapters", "schedules", "db")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


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
