"""Wake-lock hooks: shell commands run when training starts and stops, on their own thread, with a timeout."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading

import structlog

log = structlog.get_logger(__name__)


class WakeLockHooks:
    """Runs ``acquire`` when training starts and ``release`` when it stops, in order, on one worker thread.

    ``set_held`` never blocks its caller (the runner's lock, an RPC thread): commands queue up and run one at a
    time, each killed with its process group after ``timeout_s`` seconds. Repeated requests for the state already
    asked for run nothing. Empty commands are a no-op.
    """

    def __init__(self, acquire: str, release: str, timeout_s: float = 10.0) -> None:
        self.acquire, self.release, self.timeout_s = acquire, release, timeout_s
        self._held = False
        self._lock = threading.Lock()
        self._todo: queue.Queue[str | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        """True if either command is configured."""
        return bool(self.acquire or self.release)

    def set_held(self, held: bool) -> None:
        """Asks for the lock to be held (a job entered RUNNING) or released (it left); returns at once."""
        with self._lock:
            if held == self._held:
                return
            self._held = held
            cmd = self.acquire if held else self.release
            if not cmd:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="lorad-wakelock", daemon=True)
                self._thread.start()
            self._todo.put(cmd)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Runs the release command once more (a lock must never outlive the daemon), then stops the worker.

        Blocks up to ``timeout_s`` (default: two command timeouts): call it off the event loop.
        """
        with self._lock:
            self._held = False
            if self.release:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._work, name="lorad-wakelock", daemon=True)
                    self._thread.start()
                self._todo.put(self.release)
            thread = self._thread
            if thread is not None:
                self._todo.put(None)
        if thread is not None:
            thread.join(2 * self.timeout_s + 1 if timeout_s is None else timeout_s)
            with self._lock:
                if self._thread is thread and not thread.is_alive():
                    self._thread = None  # a later set_held starts a fresh worker

    def _work(self) -> None:
        while (cmd := self._todo.get()) is not None:
            self._run(cmd)

    def _run(self, cmd: str) -> None:
        # A new session, so a hung command's children are killed with it (the hook may fork helpers).
        try:
            proc = subprocess.Popen(
                cmd,
                shell=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            log.warning("wake_lock_hook_failed", command=cmd, error=str(exc)[:200])
            return
        try:
            _, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            log.warning("wake_lock_hook_timeout", command=cmd, timeout_s=self.timeout_s)
            return
        if proc.returncode != 0:
            log.warning(
                "wake_lock_hook_failed", command=cmd, code=proc.returncode, error=err.decode(errors="replace")[-300:]
            )
        else:
            log.info("wake_lock_hook_ran", command=cmd)
