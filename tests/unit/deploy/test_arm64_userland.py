"""The arm64 userland test (deploy/arm64) parses, and it and install.sh run one shared in-userland install script."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
SHARED = DEPLOY / "android" / "userland-install.sh"
IN_ROOT_PATH = "/opt/lorad/bin/lorad-userland-install"
SCRIPTS = [SHARED, DEPLOY / "arm64" / "test-userland.sh", DEPLOY / "arm64" / "e2e-inroot.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script: Path) -> None:
    shell = "sh" if script.read_text().startswith("#!/bin/sh") else "bash"
    r = subprocess.run([shutil.which(shell) or shell, "-n", str(script)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def _installs_and_runs_shared_script(text: str, source_expr: str) -> None:
    assert re.search(rf'install -m 0755 "{re.escape(source_expr)}" "\$ROOT[A-Z]*{IN_ROOT_PATH}"', text), source_expr
    assert re.search(rf"\s{IN_ROOT_PATH}\s*$", text, re.MULTILINE), "the installed copy is never run"


def test_phone_installer_and_arm64_test_share_the_in_userland_steps() -> None:
    install = (DEPLOY / "android" / "install.sh").read_text()
    arm64 = (DEPLOY / "arm64" / "test-userland.sh").read_text()
    _installs_and_runs_shared_script(install, "$HERE/userland-install.sh")
    _installs_and_runs_shared_script(arm64, "$REPO/deploy/android/userland-install.sh")
    # No second copy of the steps: apt and pip inside the userland happen only in the shared script.
    for text in (install, arm64):
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert "pip install" not in code
        assert "apt-get install -y --no-install-recommends python3" not in code
    shared = SHARED.read_text()
    assert 'pip" install' in shared and "python3 -m venv" in shared


def test_arm64_test_prints_the_summary_line_shape() -> None:
    text = (DEPLOY / "arm64" / "test-userland.sh").read_text()
    assert 'echo "test-arm64: $passed passed, $failed failed"' in text
    # Every stage named in the table has a function, and every stage is bounded in time.
    table = re.search(r"STAGES=\((.*?)\n\)", text, re.DOTALL)
    assert table is not None
    rows = [r.strip().strip('"').split() for r in table.group(1).strip().splitlines()]
    assert rows, "no stages"
    for name, limit, policy in rows:
        assert f"stage_{name}() {{" in text, name
        assert 0 < int(limit) <= 3600 and policy in ("stop", "go"), (name, limit, policy)
