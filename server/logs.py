"""structlog set up once: JSON lines when stderr is not a TTY, console otherwise; stdlib loggers routed through it."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

# Third-party loggers that would otherwise print unstructured lines (or nothing) on stderr.
ROUTED_LOGGERS = ("grpc", "apscheduler", "onnxruntime", "asyncio", "sqlalchemy")
_configured = False


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Configures structlog and the stdlib root logger (idempotent: later calls only change the level).

    Args:
        level: "debug", "info", "warning" or "error".
        fmt: "json", "console", or "auto" (JSON unless ``stream`` is a TTY).
        stream: where log lines go; default stderr.
    """
    global _configured
    stream = stream or sys.stderr
    numeric = getattr(logging, level.upper(), logging.INFO)
    if _configured:
        logging.getLogger().setLevel(numeric)
        return
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,  # request_id / app_id / job_id bound per RPC or job
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    for name in ROUTED_LOGGERS:
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # apscheduler logs every run at INFO; keep it at WARNING unless debugging.
    if numeric > logging.DEBUG:
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
        logging.getLogger("sqlalchemy").setLevel(logging.WARNING)
    _configured = True


def bind(**values: Any) -> None:
    """Binds request/job context to every log line of the current task or thread."""
    structlog.contextvars.bind_contextvars(**values)


def clear() -> None:
    """Removes all bound context of the current task or thread."""
    structlog.contextvars.clear_contextvars()
