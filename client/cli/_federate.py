"""`lorad federate join|leave|status`: a Flower SuperNode beside the daemon, for one app that opted in."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lorad.client import config as cfg
from lorad.client.cli._context import make_client, opt
from lorad.client.cli._output import EXIT_OK, print_json
from lorad.client.errors import ConfigurationError, FailedPrecondition, InvalidArgument

STOP_GRACE_S = 20.0  # SIGTERM, then SIGKILL after this many seconds


def add_parsers(sub: Any, parent: argparse.ArgumentParser) -> None:
    """Registers `federate join`, `federate leave` and `federate status`."""
    fed = sub.add_parser("federate", parents=[parent], help="take part in federated adapter training (Flower)")
    fsub = fed.add_subparsers(dest="federate_command", required=True, metavar="ACTION")
    j = fsub.add_parser("join", parents=[parent], help="start a Flower SuperNode for one app (needs --opt-in)")
    j.add_argument("--app", required=True, help="the app whose data and token the rounds use")
    j.add_argument("--superlink", required=True, help="the coordinator's SuperLink, host:port")
    j.add_argument("--datasets", required=True, help="comma-separated dataset ids of that app to train on")
    j.add_argument("--opt-in", action="store_true", help="the device owner agrees that this app takes part")
    j.add_argument("--root-certificates", help="PEM CA bundle that signed the SuperLink's TLS certificate")
    j.add_argument("--insecure", action="store_true", help="no TLS (loopback tests only)")
    j.add_argument("--auth-key", help="this SuperNode's private key (SuperLink node authentication)")
    j.add_argument(
        "--gate-wait-seconds",
        type=float,
        default=0.0,
        help="seconds a round job may wait for charger/battery/temperature before declining",
    )
    j.add_argument("--runtime-port", type=int, default=0, help="SuperNode runtime API port on 127.0.0.1 (9094)")
    j.add_argument("--foreground", action="store_true", help="run in the foreground (for runit/systemd services)")
    j.set_defaults(func=join)
    leave = fsub.add_parser("leave", parents=[parent], help="stop the app's SuperNode")
    leave.add_argument("--app", required=True)
    leave.set_defaults(func=leave_cmd)
    fsub.add_parser("status", parents=[parent], help="the SuperNodes this device runs").set_defaults(func=status)


def state_dir() -> Path:
    """Where join keeps each app's token copy (0600), pid and log: next to the client config."""
    d = Path(os.environ.get("LORAD_FEDERATION_DIR", str(cfg.config_file_path().parent / "federation")))
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def _supernode_binary() -> str:
    here = Path(sys.executable).parent / "flower-supernode"
    found = str(here) if here.exists() else shutil.which("flower-supernode")
    if not found:
        raise ConfigurationError("flower-supernode not found: pip install 'lorad[federated]'")
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_state(app: str) -> dict[str, Any] | None:
    p = state_dir() / f"{app}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def joined() -> list[dict[str, Any]]:
    """Every app this device joined: app, superlink, datasets, pid, running."""
    out = []
    for p in sorted(state_dir().glob("*.json")):
        st = json.loads(p.read_text())
        st["running"] = bool(st.get("pid")) and _alive(int(st["pid"]))
        out.append(st)
    return out


def join(args: argparse.Namespace) -> int:
    """Starts the SuperNode (detached unless --foreground) with the node config the ClientApp reads."""
    if not args.opt_in:
        raise InvalidArgument(
            "--opt-in is required: federated training uses the app's data on this device "
            "(only the adapter update leaves it)",
            field="opt-in",
        )
    if not args.insecure and not args.root_certificates:
        raise InvalidArgument("give --root-certificates PEM (TLS) or, on loopback only, --insecure", field="tls")
    prev = _read_state(args.app)
    if prev and prev.get("pid") and _alive(int(prev["pid"])):
        raise FailedPrecondition(f"app {args.app} already joined (SuperNode pid {prev['pid']}); leave first")
    with make_client(args) as c:
        c.device_status()  # the daemon answers and the token works, before anything starts
        target, token = c.settings.target, c.settings.token or ""
    d = state_dir()
    token_file = d / f"{args.app}.token"
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    node_cfg = (
        f"lorad-target='{target}' lorad-token-file='{token_file}' datasets='{args.datasets}' opt-in=true "
        f"gate-wait-seconds={float(args.gate_wait_seconds)}"
    )
    argv = [_supernode_binary(), "--superlink", args.superlink, "--node-config", node_cfg, "--host", "127.0.0.1"]
    argv += ["--insecure"] if args.insecure else ["--root-certificates", args.root_certificates]
    if args.auth_key:
        argv += ["--auth-supernode-private-key", args.auth_key]
    if args.runtime_port:
        argv += ["--port", str(args.runtime_port)]
    state = {"app": args.app, "superlink": args.superlink, "datasets": args.datasets, "started_at": time.time()}
    if args.foreground:
        (d / f"{args.app}.json").write_text(json.dumps({**state, "pid": os.getpid()}))
        return subprocess.call(argv)
    log = (d / f"{args.app}.log").open("ab")
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )
    (d / f"{args.app}.json").write_text(json.dumps({**state, "pid": proc.pid}))
    if opt(args, "json"):
        print_json({**state, "pid": proc.pid})
    else:
        print(f"joined {args.superlink} for app {args.app} (SuperNode pid {proc.pid}, log {d / (args.app + '.log')})")
    return EXIT_OK


def leave_cmd(args: argparse.Namespace) -> int:
    """Stops the app's SuperNode (SIGTERM to its process group, SIGKILL after a grace) and forgets the token copy."""
    st = _read_state(args.app)
    if st is None:
        raise FailedPrecondition(f"app {args.app} has not joined a federation on this device")
    pid = int(st.get("pid") or 0)
    if pid and _alive(pid):
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
    d = state_dir()
    for suffix in (".json", ".token"):
        (d / f"{args.app}{suffix}").unlink(missing_ok=True)
    print(f"left: app {args.app}")
    return EXIT_OK


def describe() -> list[str]:
    """One line per joined app, for `lorad status`."""
    return [
        f"federation {s['app']} → {s['superlink']} ({'running' if s['running'] else 'stopped'}, "
        f"datasets {s['datasets']})"
        for s in joined()
    ]


def status(args: argparse.Namespace) -> int:
    """Lists the joined apps and whether their SuperNodes run."""
    if opt(args, "json"):
        print_json(joined())
    else:
        print("\n".join(describe()) or "no federation joined")
    return EXIT_OK
