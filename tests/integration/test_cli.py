"""The `lorad` CLI as a user runs it: subprocesses against a gRPC server on a temp socket; --json and exit codes.

The server here is the SDK's daemon test double (tests/fixtures/fake_daemon.py), a real grpc.aio server with
in-memory state; tests/integration/test_cli_daemon.py runs the CLI against the real daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorad.v1 import jobs_pb2
from tests.fixtures.fake_daemon import OWNER_TOKEN, FakeDaemon

pytestmark = pytest.mark.integration


@pytest.fixture
def fake() -> Iterator[FakeDaemon]:
    d = Path(tempfile.mkdtemp(prefix="lorad-cli-", dir="/tmp"))
    daemon = FakeDaemon(d / "lorad.sock").start()
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(d, ignore_errors=True)


def run(
    fake: FakeDaemon | None,
    tmp: Path,
    *argv: str,
    token: str | None = None,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    e["LORAD_CLIENT_CONFIG"] = str(tmp / "client.toml")
    e["HOME"] = str(tmp)
    if fake is not None:
        e["LORAD_TARGET"] = fake.target
    if token:
        e["LORAD_TOKEN"] = token
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "lorad.client.cli", *argv],
        check=False,
        input=stdin,
        capture_output=True,
        text=True,
        env=e,
        timeout=60,
    )


def test_help_documents_exit_codes(tmp_path: Path) -> None:
    r = run(None, tmp_path, "--help")
    assert r.returncode == 0
    for code in ("0  success", "2  usage", "3  not found", "6  daemon unavailable", "8  resource exhausted"):
        assert code in r.stdout


def test_usage_error_is_exit_2(tmp_path: Path) -> None:
    assert run(None, tmp_path, "jobs", "frobnicate").returncode == 2


def test_daemon_not_running_is_exit_6_and_says_how_to_fix(tmp_path: Path) -> None:
    r = run(
        None,
        tmp_path,
        "status",
        "--target",
        str(tmp_path / "none.sock"),
        "--token",
        "t",
        "--timeout",
        "1",
        env={"LORAD_STORAGE_DATA_DIR": str(tmp_path)},
    )
    assert r.returncode == 6 and "lorad serve" in r.stderr


def test_missing_token_is_exit_5_naming_env_and_file(fake: FakeDaemon, tmp_path: Path) -> None:
    r = run(fake, tmp_path, "data", "list")
    assert r.returncode == 5
    assert "LORAD_TOKEN" in r.stderr and "client.toml" in r.stderr and "--token" in r.stderr


def test_owner_flow_register_save_then_app_calls(fake: FakeDaemon, tmp_path: Path) -> None:
    data_dir = tmp_path / "dd"
    data_dir.mkdir()
    (data_dir / "owner.token").write_text(OWNER_TOKEN + "\n")
    # --data-dir finds the owner token; --target (which outranks --data-dir) names the daemon elsewhere.
    r = run(fake, tmp_path, "--data-dir", str(data_dir), "--target", fake.target, "app", "register", "notes", "--save",
            "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["app"]["app_id"] == "notes" and out["token"] and out["saved_to"] == str(tmp_path / "client.toml")
    # The saved token is picked up by later commands without --token.
    r = run(fake, tmp_path, "data", "add", "diary", "-", stdin='{"text": "a"}\n{"text": "b"}\n', env={})
    assert r.returncode == 0, r.stderr
    assert "2 added" in r.stdout
    r = run(fake, tmp_path, "app", "list", "--json", "--data-dir", str(data_dir), "--target", fake.target)
    assert [a["app_id"] for a in json.loads(r.stdout)] == ["notes"]
    r = run(fake, tmp_path, "app", "register", "notes", "--data-dir", str(data_dir), "--target", fake.target)
    assert r.returncode == 7 and "exists" in r.stderr


def test_owner_token_missing_is_exit_5(fake: FakeDaemon, tmp_path: Path) -> None:
    r = run(fake, tmp_path, "app", "list", "--data-dir", str(tmp_path / "nowhere"))
    assert r.returncode == 5 and "owner.token" in r.stderr and "LORAD_OWNER_TOKEN" in r.stderr


def test_app_token_cannot_manage_apps(fake: FakeDaemon, tmp_path: Path) -> None:
    r = run(fake, tmp_path, "app", "list", env={"LORAD_OWNER_TOKEN": fake.app_token("notes")})
    assert r.returncode == 5 and "owner" in r.stderr.lower()


def test_data_add_files_jsonl_text_and_errors(fake: FakeDaemon, tmp_path: Path) -> None:
    tok = fake.app_token("notes")
    (tmp_path / "a.jsonl").write_text(
        '{"text": "one"}\n\n{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    )
    (tmp_path / "b.txt").write_text("para one\n\npara two\n")
    r = run(
        fake,
        tmp_path,
        "data",
        "add",
        "d",
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "b.txt"),
        "--split",
        "paragraph",
        "--json",
        token=tok,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["accepted_count"] == 4
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"messages": [{"role": "bot", "content": "x"}]}\n')
    r = run(fake, tmp_path, "data", "add", "d", str(tmp_path / "bad.jsonl"), token=tok)
    assert r.returncode == 4 and "bad.jsonl:2" in r.stderr and "role" in r.stderr
    r = run(fake, tmp_path, "data", "list", "--json", token=tok)
    assert json.loads(r.stdout)[0] == {**json.loads(r.stdout)[0], "dataset_id": "d", "sample_count": 4}
    r = run(fake, tmp_path, "data", "delete", "missing", token=tok)
    assert r.returncode == 3


def test_server_invalid_argument_reports_field_in_json(fake: FakeDaemon, tmp_path: Path) -> None:
    r = run(
        fake,
        tmp_path,
        "data",
        "add",
        "d",
        "--json",
        "--format",
        "jsonl",
        stdin='{"text": ""}\n',
        token=fake.app_token("notes"),
    )
    assert r.returncode == 4
    err = json.loads(r.stderr)["error"]
    assert err["code"] == "INVALID_ARGUMENT" and err["field"] == "samples[0].text"


def test_train_now_window_and_nightly_options(fake: FakeDaemon, tmp_path: Path) -> None:
    tok = fake.app_token("notes")
    r = run(
        fake,
        tmp_path,
        "train",
        "d",
        "--steps",
        "40",
        "--rank",
        "4",
        "--targets",
        "q_proj,v_proj",
        "--lr",
        "1e-3",
        "--seq-len",
        "128",
        "--no-require-charging",
        "--window",
        "*/5 * * * *",
        "--json",
        token=tok,
    )
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)
    assert job["config"]["max_steps"] == 40 and job["config"]["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert job["window"]["cron"] == "*/5 * * * *" and job["state"] == "queued"
    r = run(fake, tmp_path, "train", "d", "--targets", "lm_head", token=tok)
    assert r.returncode == 4 and "allowed: q_proj" in r.stderr
    r = run(fake, tmp_path, "jobs", "list", "--json", token=tok)
    assert [j["job_id"] for j in json.loads(r.stdout)] == [job["job_id"]]
    r = run(fake, tmp_path, "jobs", "show", "job_nope", token=tok)
    assert r.returncode == 3


def test_jobs_pause_cancel_and_illegal_state_exit_7(fake: FakeDaemon, tmp_path: Path) -> None:
    tok = fake.app_token("notes")
    job_id = json.loads(run(fake, tmp_path, "train", "d", "--json", token=tok).stdout)["job_id"]
    assert run(fake, tmp_path, "jobs", "pause", job_id, token=tok).returncode == 0
    r = run(fake, tmp_path, "jobs", "cancel", job_id, "--json", token=tok)
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "cancelled"
    r = run(fake, tmp_path, "jobs", "pause", job_id, token=tok)
    assert r.returncode == 7 and "CANCELLED" in r.stderr


def test_watch_plain_lines_when_not_a_tty_and_exit_codes(fake: FakeDaemon, tmp_path: Path) -> None:
    tok = fake.app_token("notes")
    job_id = json.loads(run(fake, tmp_path, "train", "d", "--json", token=tok).stdout)["job_id"]
    for step in (1, 2):
        fake.call(fake.jobs.add_event, job_id, jobs_pb2.JOB_STATE_RUNNING, step, 2, 2.5 / step)
    fake.call(fake.jobs.add_event, job_id, jobs_pb2.JOB_STATE_SUCCEEDED, 2, 2, 1.25)
    r = run(fake, tmp_path, "watch", job_id, token=tok)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout and "\x1b" not in r.stdout  # no TTY: plain lines only
    assert f"{job_id} step 1/2  loss 2.500" in r.stdout and "succeeded" in r.stdout
    r = run(fake, tmp_path, "watch", job_id, "--json", token=tok)
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["event"]["event_id"] for x in lines] == [1, 2, 3, 4] and lines[-1]["job"]["state"] == "succeeded"
    other = json.loads(run(fake, tmp_path, "train", "d", "--json", token=tok).stdout)["job_id"]
    fake.call(fake.jobs.add_event, other, jobs_pb2.JOB_STATE_CANCELLED, 0, 0, 0.0)
    assert run(fake, tmp_path, "watch", other, token=tok).returncode == 7


def test_adapters_pull_resumes_and_verifies(fake: FakeDaemon, tmp_path: Path) -> None:
    tok = fake.app_token("notes")
    fake.state.download_cut_after_chunks = [-1, 2]  # the header peek (for the file name) is not cut; the pull is
    r = run(fake, tmp_path, "adapters", "pull", "ad_1", "-o", str(tmp_path), "--json", token=tok)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert Path(res["path"]).read_bytes() == fake.state.adapter_blob and res["format"] == "peft"
    assert fake.state.download_offsets == [0, 0, 2000]  # header peek for the directory name, then resume
    r = run(fake, tmp_path, "adapters", "pull", "ad_1", "-o", str(tmp_path), token=tok)
    assert r.returncode == 7 and "--force" in r.stderr
    fake.state.adapter_sha_override = "f" * 64
    r = run(fake, tmp_path, "adapters", "pull", "ad_1", "-o", str(tmp_path / "x.tar"), token=tok)
    assert r.returncode == 1 and "sha256" in r.stderr and not (tmp_path / "x.tar").exists()


def test_generate_streams_and_json(fake: FakeDaemon, tmp_path: Path) -> None:
    tok = fake.app_token("notes")
    r = run(fake, tmp_path, "generate", "what is my dog called", "--adapter", "ad_9", token=tok)
    assert r.returncode == 0 and r.stdout == "echo[ad_9]: what is my dog called\n"
    r = run(fake, tmp_path, "generate", "-", "--json", stdin="hi", token=tok)
    assert json.loads(r.stdout) == {
        "text": "echo[base]: hi",
        "token_count": 2,
        "prompt_token_count": 1,
        "finish_reason": "stop",
    }


def test_status_human_and_json(fake: FakeDaemon, tmp_path: Path) -> None:
    tok = fake.app_token("notes")
    fake.state.can_train = False
    r = run(fake, tmp_path, "status", token=tok)
    assert r.returncode == 0 and "blocked: too hot (temperature 45.0 °C > 40.0 °C)" in r.stdout
    s = json.loads(run(fake, tmp_path, "status", "--json", token=tok).stdout)
    assert s["backend"]["backend"] == "torch" and s["readings"]["temperature_celsius"] is None
    assert s["current_job"] is None
    job_id = json.loads(run(fake, tmp_path, "train", "d", "--window", "30 2 * * *", "--json", token=tok).stdout)[
        "job_id"
    ]
    r = run(fake, tmp_path, "status", token=tok)
    assert f"job       {job_id} queued" in r.stdout
    assert json.loads(run(fake, tmp_path, "status", "--json", token=tok).stdout)["current_job"]["job_id"] == job_id


def test_data_add_reads_json_files_and_reports_errors_as_json(fake: FakeDaemon, tmp_path: Path) -> None:
    tok = fake.app_token("notes")
    (tmp_path / "a.json").write_text('\ufeff[\n  {"text": "one"},\n  {"text": "two"}\n]\n')
    r = run(fake, tmp_path, "data", "add", "diary", str(tmp_path / "a.json"), "--json", token=tok)
    assert r.returncode == 0 and json.loads(r.stdout)["accepted_count"] == 2, r.stderr
    (tmp_path / "b.json").write_text('[\n  {"text": "ok"},\n  {"messages": "nope"}\n]\n')
    r = run(fake, tmp_path, "data", "add", "diary", str(tmp_path / "b.json"), "--json", token=tok)
    err = json.loads(r.stderr)["error"]
    assert r.returncode == 4 and err["code"] == "INVALID_ARGUMENT" and f"{tmp_path / 'b.json'}:3:" in err["message"]
    r = run(fake, tmp_path, "data", "add", "diary", str(tmp_path / "missing.txt"), "--json", token=tok)
    assert r.returncode == 4 and "no such file" in json.loads(r.stderr)["error"]["message"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--steps", "-5"), "--steps must be 1 to 100000, got -5"),
        (("--steps", "0"), "--steps must be 1 to 100000, got 0"),
        (("--rank", "0"), "--rank must be 1 to 128, got 0"),
        (("--lr", "0"), "--lr must be > 0 and < 1, got 0"),
        (("--eval-every", "0"), "--eval-every must be > 0, got 0"),
        (("--eval-fraction", "0.9"), "--eval-fraction must be > 0 and ≤ 0.5, got 0.9"),
    ],
)
def test_train_options_out_of_range_name_the_option(argv: tuple[str, ...], message: str, tmp_path: Path) -> None:
    # Checked before any call: no daemon (and no token) is needed to be told what is wrong.
    r = run(None, tmp_path, "train", "diary", *argv, token="t")
    assert r.returncode == 4 and r.stderr.strip() == f"lorad: error: {message}", r.stderr
    r = run(None, tmp_path, "train", "diary", *argv, "--json", token="t")
    assert r.returncode == 4 and json.loads(r.stderr)["error"]["message"] == message


def test_usage_errors_are_json_under_json(tmp_path: Path) -> None:
    r = run(None, tmp_path, "train", "diary", "--steps", "x", "--json")
    err = json.loads(r.stderr)["error"]
    assert r.returncode == 2 and err["code"] == "USAGE" and "--steps" in err["message"] and "'x'" in err["message"]
    r = run(None, tmp_path, "adapters", "frobnicate", "--json")
    assert r.returncode == 2 and json.loads(r.stderr)["error"]["code"] == "USAGE"


def test_two_processes_pulling_to_one_path_leave_one_verified_file(fake: FakeDaemon, tmp_path: Path) -> None:
    fake.state.download_chunk_delay_s = 0.2  # ~2 s per download: the two processes overlap
    tok = fake.app_token("notes")
    dest = tmp_path / "out" / "a.tar"
    e = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    e.update(LORAD_CLIENT_CONFIG=str(tmp_path / "client.toml"), HOME=str(tmp_path), LORAD_TARGET=fake.target,
             LORAD_TOKEN=tok)  # fmt: skip
    argv = [sys.executable, "-m", "lorad.client.cli", "adapters", "pull", "ad_1", "-o", str(dest), "--force", "--json"]
    procs = [subprocess.Popen(argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert dest.read_bytes() == fake.state.adapter_blob
    assert len(fake.state.download_offsets) == 2  # both downloaded (one after the other), neither appended twice
    assert sorted(p.name for p in dest.parent.iterdir()) == ["a.tar"]
