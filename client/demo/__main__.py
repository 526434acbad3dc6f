"""Command line of the demo: `python -m lorad.client.demo [--keep] [--steps N] ...`."""

from __future__ import annotations

import argparse
import sys

from lorad.client.demo.runner import Demo, DemoSettings
from lorad.client.errors import LoradError
from lorad.client.types import Precision


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns 0 when the job succeeded and the adapter was verified."""
    d = DemoSettings()
    p = argparse.ArgumentParser(prog="python -m lorad.client.demo", description=__doc__)
    p.add_argument("--keep", action="store_true", help="keep the temporary data dir, daemon log and adapter")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps ({d.steps})")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sequence ({d.seq_len})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"sequences per step ({d.batch_size})")
    p.add_argument("--lr", type=float, default=d.learning_rate, help=f"peak learning rate ({d.learning_rate})")
    p.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank ({d.rank})")
    p.add_argument(
        "--precision",
        choices=[x.value for x in Precision],
        default=d.precision.value,
        help=f"frozen-matmul precision ({d.precision.value}; auto lets the planner choose)",
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"tokens per answer ({d.max_tokens})")
    p.add_argument("--no-window", action="store_true", help="skip the nightly-style window (start when allowed)")
    p.add_argument("--threads", type=int, default=0, help="daemon training threads (0 = torch default)")
    a = p.parse_args(argv)
    settings = DemoSettings(
        steps=a.steps,
        seq_len=a.seq_len,
        batch_size=a.batch_size,
        learning_rate=a.lr,
        rank=a.rank,
        precision=Precision(a.precision),
        max_tokens=a.max_tokens,
        use_window=not a.no_window,
        keep=a.keep,
        torch_threads=a.threads,
    )
    try:
        Demo(settings).run()
    except LoradError as err:
        print(f"demo failed: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("demo interrupted; the daemon was stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
