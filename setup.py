"""Maps the top-level folders onto the single `lorad` import root (see pyproject.toml)."""

from pathlib import Path

from setuptools import setup

ROOTS = {"lorad": "proto/lorad", "lorad.client": "client", "lorad.server": "server", "lorad.kernels": "kernels"}


def _packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        base = Path(folder)
        for init in sorted(base.rglob("__init__.py")):
            rel = init.parent.relative_to(base).parts
            if name == "lorad" and rel and rel[0] in ("client", "server", "kernels"):
                continue
            found.append(".".join((name, *rel)))
    return found


setup(
    packages=_packages(),
    package_data={
        "lorad": ["py.typed"],
        "lorad.v1": ["*.pyi", "*.proto"],
        "lorad.client": ["demo_data/*.jsonl", "demo_data/*.json"],
        "lorad.kernels": ["*.cpp"],  # fused_cpu.cpp: compiled on the machine that runs it (kernels/fused.py)
    },
)
