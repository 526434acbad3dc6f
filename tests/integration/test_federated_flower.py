"""Flower deployment engine on loopback: 1 SuperLink + 3 SuperNodes, each beside its own `lorad serve`; 3 rounds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import lorad.client as lc
from tests.integration.conftest import ServedDaemon, served_env

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOPICS = {"a": "sailing boats", "b": "mountain goats", "c": "violin strings"}  # device C never trains (gates fail)
SECRET = "zebracorn"  # a word only in the devices' samples: must never show up on the server side


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _samples(topic: str, n: int, offset: int = 0) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"{topic} {i}?"},
                          {"role": "assistant", "content": f"{topic}: {SECRET} {i}."}]}
            for i in range(offset, offset + n)]  # fmt: skip


class Proc:
    """A subprocess in its own session (so SIGKILL takes its children too), output to a log file."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.argv, self.log_path, self.env = argv, log, env
        self.log = log.open("ab")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, sig)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        self.log.close()


def _held_out_loss(model_dir: Path, adapter_dir: Path, samples: list[dict[str, Any]], cache: Path) -> float:
    """Held-out loss of base + adapter on `samples`, measured the way the daemon's trainer measures it."""
    from lorad.server.engine.adapters import load_adapter
    from lorad.server.engine.api import ChatSample, Message, TrainConfig, Trainer, prepare
    from lorad.server.engine.models.config import LoraConfig
    from lorad.server.engine.models.loader import load_model

    ad = load_adapter(adapter_dir)
    loaded = load_model(model_dir, cache_root=cache, backend="torch", precision="fp32",
                        lora=LoraConfig(rank=ad.lora.rank, alpha=ad.lora.alpha, targets=ad.lora.targets))  # fmt: skip
    loaded.model.load_lora_state_dict(ad.tensors)
    body = [ChatSample(tuple(Message(m["role"], m["content"]) for m in s["messages"])) for s in samples]
    cfg = TrainConfig(rank=ad.lora.rank, alpha=ad.lora.alpha, targets=ad.lora.targets, seq_len=256, eval_fraction=0.5,
                      backend="torch", precision="fp32", eval_batches=64)  # fmt: skip
    data = prepare(body, loaded.tokenizer, seq_len=256, eval_fraction=0.5)
    trainer = Trainer(loaded.model, cfg, data, pad_id=loaded.tokenizer.eos_id or 0)
    try:
        return float(trainer.evaluate())
    finally:
        trainer.close()


def test_three_devices_three_rounds_decline_and_sigkill(tmp_path: Path, tiny_llama: Path) -> None:
    from lorad.client.federated.ledger import read_ledger
    from lorad.server.engine.models.loader import resolve

    base_hash = resolve(tiny_llama, tmp_path / "hashcache").model_hash
    daemons: dict[str, ServedDaemon] = {}
    procs: list[Proc] = []
    try:
        for name in "abc":
            root = tmp_path / f"dev-{name}"
            root.mkdir()
            extra = {}
            if name == "c":  # a phone off its charger at 12%: the nightly gates fail
                probe = root / "probe.json"
                probe.write_text(json.dumps({"battery_percent": 12, "charging": False, "temperature_celsius": 30.0,
                                             "idle": True}))  # fmt: skip
                extra = {"LORAD_DEVICE_PROFILE": "phone", "LORAD_CONDITIONS_PROBE": "file",
                         "LORAD_CONDITIONS_PROBE_FILE": str(probe)}  # fmt: skip
            d = ServedDaemon(root, served_env(root, tiny_llama, extra))
            daemons[name] = d
            target = f"unix:{d.data_dir / 'run' / 'lorad.sock'}"
            owner = (d.data_dir / "owner.token").read_text().strip()
            with lc.Client(target, owner, timeout=60) as c:
                token = c.register_app("fedapp").token
            (root / "app.token").write_text(token)
            with lc.Client(target, token, timeout=60) as c:
                c.append_samples("notes", _samples(TOPICS[name], 24))
        link_port = _port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAD_", "FLWR_"))}
        env |= {"FLWR_HOME": str(tmp_path / "flwr"), "PATH": f"{BIN}:{env.get('PATH', '')}",
                "FLWR_DISABLE_UPDATE_CHECK": "1"}  # fmt: skip
        link = Proc([str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(link_port),
                     "--disable-runtime-dependency-installation", "--health-server-address", f"127.0.0.1:{_port()}"],
                    tmp_path / "superlink.log", env)  # fmt: skip
        procs.append(link)

        def supernode(name: str) -> Proc:
            root = tmp_path / f"dev-{name}"
            node_cfg = (f"lorad-target='unix:{daemons[name].data_dir / 'run' / 'lorad.sock'}' "
                        f"lorad-token-file='{root / 'app.token'}' datasets='notes' opt-in=true")  # fmt: skip
            p = Proc([str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                      "--host", "127.0.0.1", "--port", str(_port()), "--node-config", node_cfg],
                     tmp_path / f"supernode-{name}.log", env)  # fmt: skip
            procs.append(p)
            return p

        nodes = {n: supernode(n) for n in "abc"}
        (tmp_path / "flwr").mkdir(exist_ok=True)
        (tmp_path / "flwr" / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{link_port}"\n'
            "insecure = true\n"
        )
        out = tmp_path / "fed-out"
        run_cfg = (f"base-model-sha256='{base_hash}' model-config='{tiny_llama / 'config.json'}' out-dir='{out}' "
                   "rounds=3 rank=4 alpha=8.0 targets='q_proj,v_proj,o_proj' local-steps=6 learning-rate=0.01 "
                   "seq-len=256 batch-size=2 min-train-nodes=2 min-available-nodes=3 round-timeout=90.0 "
                   "seed=11")  # fmt: skip
        for _ in range(60):  # the SuperLink takes a few seconds to serve; `flwr run` fails fast until then
            argv = [str(BIN / "flwr"), "run", str(ROOT / "deploy" / "federated" / "app"), "loopback", "--run-config",
                    run_cfg]  # fmt: skip
            run = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=120)
            if run.returncode == 0 or "unavailable" not in run.stdout + run.stderr:
                break
            time.sleep(1)
        assert run.returncode == 0, run.stdout + run.stderr

        def wait_path(p: Path, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not p.exists():
                assert time.monotonic() < deadline, (
                    f"{p.name} not written; superlink log:\n" + ((tmp_path / "superlink.log").read_text()[-4000:])
                )
                time.sleep(0.5)

        wait_path(out / "round-001", 300)
        # Round 2: SIGKILL device B's SuperNode (and its ClientApp) while its job trains, then restart it.
        target_b = f"unix:{daemons['b'].data_dir / 'run' / 'lorad.sock'}"
        token_b = (tmp_path / "dev-b" / "app.token").read_text()
        with lc.Client(target_b, token_b, timeout=30) as c:
            deadline = time.monotonic() + 120
            while not any(j.request_id.endswith("-2") and not j.is_final for j in c.list_jobs()):
                assert time.monotonic() < deadline, "device B never started round 2"
                time.sleep(0.2)
        nodes["b"].kill(signal.SIGKILL)
        nodes["b"] = supernode("b")
        wait_path(out / "summary.json", 400)
        with lc.Client(target_b, token_b, timeout=30) as c:
            # The restarted B's round 3 reaped what the killed round 2 left: no job trains on for nobody, and no
            # round's adapter stays behind in the app's quota.
            assert all(j.is_final for j in c.list_jobs()), c.list_jobs()
            assert c.list_adapters() == []
    finally:
        for p in procs:
            p.kill()
        for d in daemons.values():
            d.stop()

    summary = json.loads((out / "summary.json").read_text())
    ledger = read_ledger(out / "ledger.jsonl")
    ups = [e for e in ledger if e.direction == "up"]
    for r in (1, 2, 3):
        assert (out / f"round-{r:03d}" / "adapter_model.safetensors").is_file(), r
        assert any(e.round == r and e.status == "accepted" for e in ups), (r, ups)
    # Device C declined every round with its gate's code; the rounds went on.
    declined = [e for e in ups if e.status == "declined"]
    assert {e.round for e in declined} >= {1, 2, 3} and all(e.reason in ("not_charging", "battery_low")
                                                            for e in declined), declined  # fmt: skip
    # Round 2 lost B (killed) but completed; round 3 has a node that first appears after the kill (B rejoined).
    r1_nodes = {e.node_id for e in ups if e.round == 1}
    r3_new = {e.node_id for e in ups if e.round == 3 and e.status == "accepted"} - r1_nodes
    assert r3_new, ups
    accepted_r2 = [e for e in ups if e.round == 2 and e.status == "accepted"]
    assert len(accepted_r2) == 1, ups
    failed_r2 = [e for e in ups if e.round == 2 and e.status == "failed"]
    assert [e.node_id for e in failed_r2] == [
        n for n in r1_nodes if n not in {e.node_id for e in accepted_r2} and n not in {e.node_id for e in declined}
    ], ups  # B, by its node id
    # Bytes per device per round: FFA sends only B, both ways.
    downs = [e.bytes for e in ledger if e.direction == "down"]
    assert downs and all(b > 0 for b in downs)
    assert summary["round_seconds"]
    # The global adapter's held-out loss on the union of A's and B's (unseen) data improves over round 0.
    held_out = _samples(TOPICS["a"], 12, offset=100) + _samples(TOPICS["b"], 12, offset=100)
    cache = tmp_path / "evalcache"
    before = _held_out_loss(tiny_llama, out / "round-000", held_out, cache)
    after = _held_out_loss(tiny_llama, out / "round-003", held_out, cache)
    assert after < before - 0.01, (before, after)
    # Nothing of the samples reached the server side: logs, ledger, summary, adapters' metadata, flwr's output.
    server_side = [tmp_path / "superlink.log", out / "ledger.jsonl", out / "summary.json"]
    server_side += list(out.glob("round-*/*.json"))
    for p in server_side:
        text = p.read_text(errors="replace")
        assert SECRET not in text and "sailing" not in text and "mountain" not in text, p
    assert SECRET not in run.stdout + run.stderr
