"""Logging: JSON lines off a TTY, stdlib loggers routed through structlog, context bound per task."""

import io
import json
import logging

import structlog

from lorad.server import logs


def test_json_lines_with_context_and_stdlib_routing(monkeypatch) -> None:
    monkeypatch.setattr(logs, "_configured", False)
    buf = io.StringIO()
    logs.configure_logging("info", "auto", stream=buf)  # StringIO is not a TTY -> JSON
    try:
        logs.bind(request_id="r1", app_id="notes")
        structlog.get_logger("lorad.test").info("job_started", job_id="job_1")
        logging.getLogger("apscheduler.scheduler").warning("stdlib says %s", "hi")
        logs.clear()
        lines = [json.loads(x) for x in buf.getvalue().splitlines()]
        assert lines[0]["event"] == "job_started" and lines[0]["app_id"] == "notes" and lines[0]["job_id"] == "job_1"
        assert lines[0]["level"] == "info" and "timestamp" in lines[0]
        assert lines[1]["event"] == "stdlib says hi" and lines[1]["logger"] == "apscheduler.scheduler"
    finally:
        logs.clear()
        structlog.reset_defaults()
        logging.getLogger().handlers[:] = []
        monkeypatch.setattr(logs, "_configured", False)
