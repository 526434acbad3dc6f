"""`lorad prepare`: build QNN EP-context bundles for a target SoC on a host, list targets, check a bundle."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import structlog

from lorad.server.engine.prepare.manifest import BundleError
from lorad.server.engine.prepare.socs import SOCS, resolve_soc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lorad prepare",
        description="Build the QNN HTP context binaries a model needs on a target Snapdragon SoC into a bundle "
        "directory (copy it to the phone and set [training] qnn_bundle). Runs on x86_64 or aarch64 hosts.",
    )
    p.add_argument("--model", type=Path, help="Hugging Face model folder (config.json + *.safetensors)")
    p.add_argument("--soc", help="target SoC: part number or name, e.g. SM8650 or '8 Gen 3' (see --list-socs)")
    p.add_argument("--out", type=Path, help="bundle directory to create")
    p.add_argument("--precision", default="fp16", help="precision of every layer the plan does not name (fp16)")
    p.add_argument("--plan", type=Path, help="precision plan JSON (lorad.kernels PrecisionPlan or {layer: {fwd, bwd}})")
    p.add_argument("--bucket", type=int, action="append", help="token bucket, repeatable (default 256)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--check",
        action="store_true",
        help="after building, load the bundle on this host's HTP "
        "(the simulator on x86) and compare every graph with a fresh build",
    )
    p.add_argument("--check-only", type=Path, metavar="BUNDLE", help="only check an existing bundle (needs --model)")
    p.add_argument("--check-limit", type=int, help="check only the first N linears")
    p.add_argument("--list-socs", action="store_true", help="print the known target SoCs and exit")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    return p


def prepare_main(argv: list[str]) -> int:
    """Entry point of `lorad prepare` (the CLI passes the arguments after `prepare`).

    Returns:
        0 on success, 2 on bad arguments, 1 when building or checking fails (the reason goes to stderr).
    """
    args = _parser().parse_args(argv)
    configured_here = not structlog.is_configured()
    if configured_here:
        # Per-graph debug events would drown the summary; undone on return so in-process callers keep theirs.
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        return _run(args)
    finally:
        if configured_here:
            structlog.reset_defaults()


def _run(args: argparse.Namespace) -> int:
    if args.list_socs:
        for t in SOCS:
            print(f"{t.chip:8s} {t.name:38s} soc_model={t.soc_model:3s} htp_arch={t.htp_arch}")
        return 0
    from lorad.server.engine.prepare.build import build_bundle
    from lorad.server.engine.prepare.load import check_bundle

    try:
        if args.check_only:
            if not args.model:
                print("lorad prepare: --check-only needs --model", file=sys.stderr)
                return 2
            result: dict[str, object] = {
                "bundle": str(args.check_only),
                "check": check_bundle(args.check_only, args.model, limit=args.check_limit),
            }
        else:
            missing = [f"--{k}" for k in ("model", "soc", "out") if getattr(args, k) is None]
            if missing:
                print(f"lorad prepare: missing {', '.join(missing)} (see --help)", file=sys.stderr)
                return 2
            target = resolve_soc(args.soc)
            m = build_bundle(
                args.model,
                target,
                args.out,
                precision=args.precision,
                plan_file=args.plan,
                buckets=tuple(args.bucket or (256,)),
                force=args.force,
            )
            result = {
                "bundle": str(args.out),
                "soc": target.label,
                "graphs": len(m.graphs),
                "bytes": sum({g.file: g.bytes for g in m.graphs}.values()),
                "model_hash": m.model_hash,
                "buckets": list(m.buckets),
            }
            print(f"wrote {args.out}: {len(m.graphs)} graphs for {target.label}, model {m.model_hash[:12]}")
            if args.check:
                result["check"] = check_bundle(args.out, args.model, limit=args.check_limit)
        if "check" in result:
            c = result["check"]
            assert isinstance(c, dict)
            print(
                f"check: {c['graphs']} graphs loaded from the bundle; max |bundle - fresh build| = "
                f"{c['max_abs_diff']:.3g} (outputs up to {c['max_ref']:.3g})"
            )
            if c["max_abs_diff"] > 0:
                print("check FAILED: bundle outputs differ from a fresh build", file=sys.stderr)
                return 1
    except (ValueError, FileExistsError, FileNotFoundError, KeyError, BundleError, RuntimeError) as exc:
        print(f"lorad prepare: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    return 0
