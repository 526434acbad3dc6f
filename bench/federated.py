"""Federated round benchmark on loopback: bytes per device per round and round wall time, SmolLM2-135M real weights.

One SuperLink + N SuperNodes, each beside its own `lorad serve` on the bundled SmolLM2-135M-Instruct (the default
model), every address on 127.0.0.1. The devices split the demo data (client/demo_data/mara.jsonl). The ServerApp's
ledger gives the bytes sent to and received from each device per round; its summary the round wall times.

    .venv/bin/python bench/federated.py                         # 3 devices, 3 rounds, 10 local steps, rank 8, q/v
    .venv/bin/python bench/federated.py --devices 2 --rounds 1 --steps 2 --seq-len 64   # a quick check
    .venv/bin/python bench/federated.py --mode naive            # A and B travel (the baseline): twice the bytes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: timed out waiting for {what}")
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="local steps per round")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--mode", default="ffa", choices=("ffa", "naive"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = ap.parse_args()

    import lorad.client as lc
    from lorad.client.federated.ledger import read_ledger
    from lorad.server.engine.api import resolve

    work = Path(tempfile.mkdtemp(prefix="lorad-bench-fed-"))
    lines = (ROOT / "client" / "demo_data" / "mara.jsonl").read_text().splitlines()
    procs: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAD_", "FLWR_"))}
    env |= {"PATH": f"{BIN}:{env.get('PATH', '')}", "FLWR_HOME": str(work / "flwr"), "FLWR_DISABLE_UPDATE_CHECK": "1"}
    t_setup = time.perf_counter()
    try:
        ck = resolve(None, work / "hashcache")  # the bundled SmolLM2-135M-Instruct GGUF, converted once
        sockets = []
        for i in range(a.devices):
            root = work / f"dev{i}"
            root.mkdir()
            denv = env | {"HOME": str(root), "LORAD_CLIENT_CONFIG": str(root / "client.toml"),
                          "LORAD_STORAGE_DATA_DIR": str(root / "data"), "LORAD_LOGGING_LEVEL": "warning",
                          "LORAD_TRAINING_TORCH_THREADS": "1"}  # fmt: skip
            procs.append(_start([sys.executable, "-m", "lorad.client.cli", "serve"], root / "serve.log", denv))
            sock = root / "data" / "run" / "lorad.sock"
            _wait(sock.exists, 120, f"lorad serve {i}")
            sockets.append(sock)
            target = f"unix:{sock}"
            with lc.Client(target, (root / "data" / "owner.token").read_text().strip(), timeout=120) as c:
                token = c.register_app("bench").token
            (root / "app.token").write_text(token)
            with lc.Client(target, token, timeout=120) as c:
                c.append_samples("notes", [json.loads(x) for x in lines[i :: a.devices]])
        link = _port()
        procs.append(_start([str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(link),
                             "--disable-runtime-dependency-installation"], work / "superlink.log", env))  # fmt: skip
        for i, sock in enumerate(sockets):
            cfg = (f"lorad-target='unix:{sock}' lorad-token-file='{work / f'dev{i}' / 'app.token'}' "
                   "datasets='notes' opt-in=true job-timeout-seconds=3600")  # fmt: skip
            procs.append(_start([str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link}",
                                 "--host", "127.0.0.1", "--port", str(_port()), "--node-config", cfg],
                                work / f"supernode{i}.log", env))  # fmt: skip
        (work / "flwr").mkdir()
        (work / "flwr" / "config.toml").write_text(
            f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{link}"\ninsecure = true\n'
        )
        out = work / "out"
        run_cfg = (f"base-model-sha256='{ck.model_hash}' model-config='{ck.path / 'config.json'}' out-dir='{out}' "
                   f"rounds={a.rounds} rank={a.rank} alpha={2.0 * a.rank} targets='{a.targets}' mode='{a.mode}' "
                   f"local-steps={a.steps} seq-len={a.seq_len} min-train-nodes={a.devices} "
                   f"min-available-nodes={a.devices} round-timeout=3600.0")  # fmt: skip
        argv = [str(BIN / "flwr"), "run", str(ROOT / "deploy" / "federated" / "app"), "bench", "--run-config", run_cfg]
        for _ in range(60):
            r = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=120)
            if r.returncode == 0 or "unavailable" not in r.stdout + r.stderr:
                break
            time.sleep(1)
        if r.returncode != 0:
            raise SystemExit(f"bench: flwr run failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
        setup_s = time.perf_counter() - t_setup
        _wait((out / "summary.json").exists, 6 * 3600, "the run to finish")
    finally:
        for p in reversed(procs):
            _stop(p)
    summary = json.loads((out / "summary.json").read_text())
    ledger = read_ledger(out / "ledger.jsonl")
    print(
        f"federated {a.mode}: SmolLM2-135M-Instruct, {a.devices} loopback devices, {a.rounds} rounds, "
        f"{a.steps} local steps, seq {a.seq_len}, rank {a.rank}, targets {a.targets}; setup {setup_s:.1f} s"
    )
    print(f"{'round':>5} {'device(node)':>22} {'down B':>10} {'up B':>10} {'status':>9}")
    rows = []
    for e in sorted(ledger, key=lambda e: (e.round, e.node_id, e.direction)):
        if e.direction == "up":
            down = next((d.bytes for d in ledger if d.round == e.round and d.node_id == e.node_id and
                         d.direction == "down"), 0)  # fmt: skip
            rows.append({"round": e.round, "node": e.node_id, "down": down, "up": e.bytes, "status": e.status})
            print(f"{e.round:>5} {e.node_id:>22} {down:>10,} {e.bytes:>10,} {e.status:>9}")
    for rnd, secs in sorted(summary["round_seconds"].items(), key=lambda kv: int(kv[0])):
        m = summary["train_metrics"].get(rnd) or summary["train_metrics"].get(int(rnd)) or {}
        print(f"round {rnd}: wall {float(secs):.1f} s, eval loss before {m.get('eval_loss_before', float('nan')):.4f}"
              f" -> after {m.get('eval_loss', float('nan')):.4f}")  # fmt: skip
    if a.json:
        print(json.dumps({"mode": a.mode, "devices": a.devices, "rows": rows, "round_seconds": summary["round_seconds"],
                          "setup_seconds": round(setup_s, 1)}))  # fmt: skip
    if not a.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
