"""One daemon per data directory (an exclusive flock taken before anything else) and private directories."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

LOCK_FILE = "lorad.lock"


class StartRefusedError(Exception):
    """The daemon must not start; the message says why and what to do."""


def private_dir(path: Path, what: str) -> None:
    """Creates ``path`` with mode 0700, or checks that an existing one is private and ours (never changes its mode).

    Raises:
        StartRefusedError: the directory exists but another user owns it or others can reach into it.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
        path.chmod(0o700)  # lorad created it: mkdir's mode is masked by the umask
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise StartRefusedError(f"{what} {path} is not a directory")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise StartRefusedError(
            f"{what} {path} is not private (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}); "
            f"point lorad at a directory only you can use (mode 0700, owned by uid {os.getuid()}) or at one that "
            "does not exist yet (lorad creates it private); lorad never changes the mode of a directory it did not "
            "create"
        )


class DataDirLock:
    """``<data_dir>/lorad.lock`` held with flock(LOCK_EX) for the daemon's lifetime; it holds the owner's PID."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock or raises naming the daemon that holds it.

        Raises:
            StartRefusedError: another process holds the lock.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StartRefusedError(
                f"another lorad (pid {pid}) is already serving data dir {self.path.parent}; stop it first "
                f"(e.g. kill {pid}) or use another --data-dir. Its socket was left alone."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Drops the lock (the kernel drops it too when the process dies, also on kill -9)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None
