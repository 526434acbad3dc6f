"""The `lorad` CLI in subprocesses against the REAL daemon (in-process, temp data dir, tiny random Llama)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lorad.kernels import fused

pytestmark = pytest.mark.integration


def lorad(tmp: Path, h: Any, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env.update(HOME=str(tmp), LORAD_CLIENT_CONFIG=str(tmp / "client.toml"), LORAD_STORAGE_DATA_DIR=str(h.data_dir))
    return subprocess.run(
        [sys.executable, "-m", "lorad.client.cli", *argv],
        check=False, input=stdin, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def test_cli_session_against_real_daemon(make_daemon: Any, tmp_path: Path) -> None:
    h = make_daemon()
    # The socket and the owner token are both found from LORAD_STORAGE_DATA_DIR alone.
    r = lorad(tmp_path, h, "app", "register", "notes", "--save")
    assert r.returncode == 0, r.stderr
    assert "saved to" in r.stdout
    r = lorad(tmp_path, h, "app", "list", "--json")
    assert [a["app_id"] for a in json.loads(r.stdout)] == ["notes"]

    data = tmp_path / "notes.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]}
             for i in range(10)] + [{"text": f"A note about day {i}."} for i in range(6)]  # fmt: skip
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = lorad(tmp_path, h, "data", "add", "diary", str(data), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["accepted_count"] == 16
    r = lorad(tmp_path, h, "data", "add", "diary", stdin='{"messages": [{"role": "nobody", "content": "x"}]}\n')
    assert r.returncode == 4 and "<stdin>:1" in r.stderr

    r = lorad(tmp_path, h, "train", "diary", "--steps", "4", "--seq-len", "64", "--batch-size", "2", "--rank", "4",
              "--eval-every", "2", "--eval-fraction", "0.3", "--watch", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    updates = [json.loads(x) for x in r.stdout.splitlines()]
    job = updates[-1]["job"]
    assert job["state"] == "succeeded" and job["progress"]["step"] == 4 and job["adapter_id"]
    assert any(u["event"]["kind"] == "progress" for u in updates)

    r = lorad(tmp_path, h, "watch", job["job_id"])
    assert r.returncode == 0 and "succeeded" in r.stdout and "\x1b" not in r.stdout
    r = lorad(tmp_path, h, "jobs", "show", job["job_id"], "--json")
    assert json.loads(r.stdout)["job"]["job_id"] == job["job_id"]
    assert lorad(tmp_path, h, "jobs", "pause", job["job_id"]).returncode == 7
    assert lorad(tmp_path, h, "jobs", "show", "job_nope").returncode == 3

    r = lorad(tmp_path, h, "adapters", "list", "--json")
    assert [a["adapter_id"] for a in json.loads(r.stdout)] == [job["adapter_id"]]
    r = lorad(tmp_path, h, "adapters", "pull", job["job_id"], "-o", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    pulled = json.loads(r.stdout)
    assert hashlib.sha256(Path(pulled["path"]).read_bytes()).hexdigest() == pulled["sha256"]

    r = lorad(tmp_path, h, "generate", "Q3?", "--adapter", job["adapter_id"], "--max-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_count"] <= 6
    r = lorad(tmp_path, h, "status", "--json")
    s = json.loads(r.stdout)
    assert s["readings"]["charging"] is True and s["can_train"] is True
    out = lorad(tmp_path, h, "status").stdout
    assert "training  allowed now" in out
    # the daemon runs in this process and trained above: its kernels were decided the same way
    assert ("kernels   active" if fused.kernels() is not None else "kernels   inactive") in out
    assert s["backend"]["cpu_kernels"]["active"] is (fused.kernels() is not None)

    r = lorad(tmp_path, h, "data", "delete", "diary", "--with-adapters", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"dataset_id": "diary", "deleted_samples": 16, "deleted_adapters": 1}
    r = lorad(tmp_path, h, "adapters", "list", "--json")
    assert json.loads(r.stdout) == [], "the adapter that learned the diary went with it"

    r = lorad(tmp_path, h, "app", "revoke", "notes")
    assert r.returncode == 0
    r = lorad(tmp_path, h, "data", "list")
    assert r.returncode == 5  # the saved token was revoked


def test_cli_chat_tries_an_adapter_line_by_line_and_generate_takes_sampling_flags(
    make_daemon: Any, tmp_path: Path
) -> None:
    from lorad.v1 import jobs_pb2
    from tests.integration.helpers import FINAL, Stubs, append, create_job, wait_state

    h = make_daemon()
    r = lorad(tmp_path, h, "app", "register", "notes", "--save", "--json")
    assert r.returncode == 0, r.stderr
    token = json.loads(r.stdout)["token"]
    app = Stubs(h.channel(), token)
    append(app)
    job = create_job(app, steps=2)
    assert wait_state(app, job.job_id, FINAL, 120).state == jobs_pb2.JOB_STATE_SUCCEEDED

    # A job id names its adapter; each stdin line is one user turn, earlier turns go along with the next.
    r = lorad(tmp_path, h, "chat", "--adapter", job.job_id, "--max-tokens", "4", "--json",
              stdin="What is note 3 about?\n\nAnd note 4?\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    turns = [json.loads(x) for x in r.stdout.splitlines()]
    assert [t["user"] for t in turns] == ["What is note 3 about?", "And note 4?"], "blank lines are skipped"
    assert all(t["finish_reason"] == "length" for t in turns)
    assert turns[1]["prompt_token_count"] > turns[0]["prompt_token_count"] + 4, "the first exchange goes along"
    r = lorad(tmp_path, h, "chat", "--adapter", job.job_id, "--max-tokens", "3", stdin="hi\n")
    assert r.returncode == 0 and r.stdout.endswith("\n") and "> " not in r.stdout, "no prompt when piped"

    r = lorad(tmp_path, h, "generate", "hi", "--repetition-penalty", "3")
    assert r.returncode == 4 and "repetition_penalty" in r.stderr and "3" in r.stderr, r.stderr
    args = ("generate", "Hello", "--raw", "--max-tokens", "24")
    looped = lorad(tmp_path, h, *args, "--repetition-penalty", "1", "--json")
    default = lorad(tmp_path, h, *args, "--json")
    assert looped.returncode == 0 and default.returncode == 0, default.stderr
    # the flag reaches the daemon: switching the penalty off changes greedy output
    assert json.loads(looped.stdout)["text"] != json.loads(default.stdout)["text"]


def _cli(tmp: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    e.update(HOME=str(tmp), LORAD_CLIENT_CONFIG=str(tmp / "client.toml"), **env)
    return subprocess.run([sys.executable, "-m", "lorad.client.cli", *argv], check=False, capture_output=True,
                          text=True, env=e, timeout=120)  # fmt: skip


def _note(tmp: Path) -> Path:
    p = tmp / "d1.txt"
    p.write_text("a note only d1 has\n")
    return p


def test_data_dir_names_the_daemon_even_with_a_saved_target(make_daemon: Any, tmp_path: Path) -> None:
    d1, d2 = make_daemon("d1"), make_daemon("d2")
    # The device owner of d1 registers an app and saves its token and target (d1's socket) in client.toml.
    assert _cli(tmp_path, "--data-dir", str(d1.data_dir), "app", "register", "notes", "--save").returncode == 0
    r = _cli(tmp_path, "data", "add", "diary", str(_note(tmp_path)))
    assert r.returncode == 0, r.stderr
    # An owner command with --data-dir d2 goes to d2 (with d2's owner.token), not to the saved target.
    r = _cli(tmp_path, "--data-dir", str(d2.data_dir), "app", "list", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
    # An app command there does not send d1's saved token to d2: it asks for a token for d2.
    r = _cli(tmp_path, "--data-dir", str(d2.data_dir), "data", "list")
    assert r.returncode == 5 and "no app token" in r.stderr, r.stderr
    _, tok2 = d2.register("notes")
    r = _cli(tmp_path, "--data-dir", str(d2.data_dir), "--token", tok2, "data", "list", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stdout  # d2's (empty) data, not d1's "diary"
    # A bad owner token names where it came from, never "argument".
    r = _cli(tmp_path, "--data-dir", str(d2.data_dir), "app", "list", LORAD_OWNER_TOKEN="wrong")
    assert r.returncode == 5 and "token from LORAD_OWNER_TOKEN" in r.stderr, r.stderr
    r = _cli(tmp_path, "--data-dir", str(d2.data_dir), "--token", "wrong", "app", "list")
    assert r.returncode == 5 and "token from --token" in r.stderr and "argument" not in r.stderr, r.stderr


def test_status_reports_the_models_family_weight_count_and_hash(make_daemon: Any, tmp_path: Path) -> None:
    import math

    from safetensors import safe_open

    from lorad.server.engine.models.loader import load_model

    h = make_daemon()
    assert lorad(tmp_path, h, "app", "register", "notes", "--save").returncode == 0
    deadline = time.monotonic() + 60
    while True:  # status never waits for a model's first read: it says so until the facts are known
        r = lorad(tmp_path, h, "status", "--json")
        assert r.returncode == 0, r.stderr
        (m,) = json.loads(r.stdout)["models"]
        if m["parameters"] or time.monotonic() > deadline:
            break
        assert m["detail"].startswith("reading the model for the first time"), m
        time.sleep(0.2)
    model_dir = Path(h.daemon.cfg.training.default_model)
    expected = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            expected += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118
    assert m["family"] == "llama" and m["parameters"] == expected > 0
    loaded = load_model(model_dir, cache_root=tmp_path / "cache", backend="torch", precision="fp32", lora=None)
    assert m["sha256"] == loaded.model_hash and len(m["sha256"]) == 64
    r = lorad(tmp_path, h, "status")
    assert f"({m['family']}, {round(expected / 1e3)}K params) default" in r.stdout, r.stdout


def test_adapters_list_show_delete_and_pull_into_a_new_directory(make_daemon: Any, tmp_path: Path) -> None:
    h = make_daemon()
    assert lorad(tmp_path, h, "app", "register", "notes", "--save").returncode == 0
    (tmp_path / "n.txt").write_text("\n\n".join(f"Note {i}: the lazy dog sleeps." for i in range(12)))
    assert lorad(tmp_path, h, "data", "add", "diary", str(tmp_path / "n.txt"), "--split", "paragraph").returncode == 0
    r = lorad(tmp_path, h, "train", "diary", "--steps", "2", "--seq-len", "32", "--rank", "2", "--eval-every", "1000",
              "--watch", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout.splitlines()[-1])["job"]
    listing = lorad(tmp_path, h, "adapters", "list").stdout
    assert job["adapter_id"] in listing and "nan" not in listing, listing
    # `show` takes the job id like `delete` does, and prints a summary instead of one row per layer.
    shown = lorad(tmp_path, h, "adapters", "show", job["job_id"])
    assert shown.returncode == 0 and job["adapter_id"] in shown.stdout and "--layers lists each" in shown.stdout
    assert len(shown.stdout.splitlines()) <= 6 and "nan" not in shown.stdout, shown.stdout
    plan = json.loads(lorad(tmp_path, h, "adapters", "show", job["adapter_id"], "--json").stdout)["precision_plan"]
    assert f"layers   {len(plan)} (" in shown.stdout
    layers = lorad(tmp_path, h, "adapters", "show", job["adapter_id"], "--layers").stdout.splitlines()
    assert layers[-1 - len(plan)].split() == ["LAYER", "FORWARD", "BACKWARD"]
    # -o dir/ creates the directory and writes inside it.
    r = lorad(tmp_path, h, "adapters", "pull", job["job_id"], "-o", f"{tmp_path}/new/", "--json")
    assert r.returncode == 0, r.stderr
    assert Path(json.loads(r.stdout)["path"]).parent == tmp_path / "new"
    # delete asks first; without a terminal it refuses unless --yes.
    r = lorad(tmp_path, h, "adapters", "delete", job["job_id"])
    assert r.returncode == 4 and "--yes" in r.stderr
    assert job["adapter_id"] in lorad(tmp_path, h, "adapters", "list").stdout
    r = lorad(tmp_path, h, "adapters", "delete", job["job_id"], "--yes")
    assert r.returncode == 0 and "deleted" in r.stdout
    assert lorad(tmp_path, h, "adapters", "list").stdout.strip() == "(none)"
