"""The lorad daemon: gRPC API (rpc/), SQLite store (store/), jobs and the NPU runner (jobs/), scheduling
(scheduler/), device conditions (device/), plus models/, training/ and adapters/ (the training engine).

Public surface: ``serve_main(argv) -> int`` (the ``lorad serve`` entry point) and ``daemon.Daemon`` (in-process use).
"""

from __future__ import annotations

from collections.abc import Sequence


def serve_main(argv: Sequence[str]) -> int:
    """Runs the daemon until SIGTERM/SIGINT; see ``lorad.server.daemon.serve_main``. First re-executes itself with
    tcmalloc preloaded where ``training.allocator`` wants it (server/allocator.py)."""
    from lorad.server.allocator import reexec_with_allocator

    code = reexec_with_allocator(argv)
    if code is not None:
        return code
    from lorad.server.daemon import serve_main as _serve_main

    return _serve_main(argv)


__all__ = ["serve_main"]
