"""A resumable download target: bytes go to `<file>.part`, verified, then fsync + rename into place."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, BinaryIO

import grpc

from lorad.client._atomic import replace_durably
from lorad.client.errors import IntegrityError, InvalidArgument, LoradError, Unavailable
from lorad.client.retry import RetryPolicy
from lorad.client.types import AdapterFormat, DownloadResult

log = logging.getLogger(__name__)
ProgressCallback = Callable[[int, int], None]

_HASH_BLOCK = 1 << 20  # bytes read at a time when re-hashing an existing .part file


class DownloadLock:
    """An exclusive lock on `<final>.lock` (flock: works across threads and processes) held for one download.

    Two pulls to the same path would otherwise append to the same `.part` file. The lock file is removed on
    release; a waiter that then holds a lock on the removed file notices (different inode) and locks again.
    """

    POLL_S = 0.05  # polled, not blocking in a thread, so a cancelled download stops waiting at once

    def __init__(self, final: Path) -> None:
        self.path = final.with_name(final.name + ".lock")
        self._fd = -1

    async def __aenter__(self) -> DownloadLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        await asyncio.sleep(self.POLL_S)
                try:
                    current = self.path.stat().st_ino
                except FileNotFoundError:
                    current = -1
            except BaseException:
                os.close(fd)
                raise
            if current == os.fstat(fd).st_ino:
                self._fd = fd
                return self
            os.close(fd)  # the holder before us removed this file: lock the new one

    async def __aexit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = -1


class IncompleteDownloadError(IntegrityError):
    """The stream ended before the announced size; resuming can complete it."""


def safe_filename(name: str, fallback: str) -> str:
    """The daemon's suggested file name reduced to a plain name (no directories, no leading dots)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", Path(name).name).lstrip(".")
    return base or fallback


class PartFile:
    """Receives one file's bytes in order, possibly across several streams, into `<final>.part`."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.part = final.with_name(final.name + ".part")
        self._fh: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._size = 0
        self._total = -1
        self._sha256 = ""

    def existing_size(self) -> int:
        """Bytes already in the .part file (0 if there is none): the offset to resume from."""
        try:
            return self.part.stat().st_size
        except FileNotFoundError:
            return 0

    def begin(self, total_size: int, sha256: str) -> None:
        """Opens the .part file for appending after a stream's header announced the whole file."""
        self.close()
        self._total, self._sha256 = total_size, sha256.lower()
        self.part.parent.mkdir(parents=True, exist_ok=True)
        if self.existing_size() > total_size:
            self.part.unlink()  # left over from another file: start over
        self._hash = hashlib.sha256()
        self._fh = self.part.open("a+b")  # held open across chunks; closed in close()
        self._fh.seek(0)
        while block := self._fh.read(_HASH_BLOCK):
            self._hash.update(block)
        self._size = self._fh.tell()

    def write(self, offset: int, data: bytes) -> None:
        """Appends the chunk that starts at `offset`.

        Raises:
            IntegrityError: The chunk is not the next one, or the file grows past its announced size.
        """
        if self._fh is None:
            raise IntegrityError("download stream sent a chunk before its header")
        if offset != self._size:
            raise IntegrityError(f"download chunk at offset {offset}, expected {self._size}")
        if self._size + len(data) > self._total:
            raise IntegrityError(f"download exceeds the announced size of {self._total} bytes")
        self._fh.write(data)
        self._hash.update(data)
        self._size += len(data)

    @property
    def size(self) -> int:
        """Bytes received so far, including any resumed prefix."""
        return self._size

    @property
    def total(self) -> int:
        """The announced size of the whole file, bytes (-1 before the header)."""
        return self._total

    def finish(self, fmt: AdapterFormat, resumed_from: int) -> DownloadResult:
        """Verifies size and sha256, then fsyncs and renames the .part file into place.

        Raises:
            IncompleteDownloadError: Fewer bytes than announced arrived (resume to complete).
            IntegrityError: The size or digest differs from the header.
        """
        if self._fh is None:
            raise IncompleteDownloadError("download stream ended before its header")
        if self._size < self._total:
            raise IncompleteDownloadError(f"download stream ended at {self._size} of {self._total} bytes")
        digest = self._hash.hexdigest()
        if digest != self._sha256:
            raise IntegrityError(
                f"sha256 of {self.part} is {digest}, the daemon announced {self._sha256}; the file was discarded"
            )
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.close()
        replace_durably(self.part, self.final)
        return DownloadResult(str(self.final), self._size, digest, fmt, resumed_from)

    def discard(self) -> None:
        """Deletes the .part file (its content cannot be trusted)."""
        self.close()
        self.part.unlink(missing_ok=True)
        self._size = 0

    def close(self) -> None:
        """Closes the .part file, keeping its content for a later resume."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


async def resumable_download(
    open_stream: Callable[[int], AsyncIterator[Any]],
    part: PartFile,
    fmt: AdapterFormat,
    retry: RetryPolicy,
    map_error: Callable[[grpc.RpcError], LoradError],
    *,
    on_progress: ProgressCallback | None = None,
) -> DownloadResult:
    """Streams DownloadAdapter responses into `part` from its current size until the file is complete and verified.

    A broken or short stream is reopened at the received offset (with backoff; attempts reset on progress). A .part
    file that turns out stale (digest mismatch or an offset the daemon rejects) is discarded and the download
    restarted once; a fresh download that fails verification is discarded and raised.

    Args:
        open_stream: Opens the DownloadAdapter stream at a byte offset.
        part: Where the bytes go.
        fmt: The format asked for (recorded in the result).
        retry: Backoff policy for UNAVAILABLE.
        map_error: Converts a gRPC error into the SDK's typed error.
        on_progress: Called with (bytes received, total bytes) after each chunk.
    """
    resumed_from = part.existing_size()
    failures, restarted = 0, False
    while True:
        offset = part.existing_size()
        stream = open_stream(offset)
        try:
            async for msg in stream:
                if msg.WhichOneof("payload") == "header":
                    part.begin(msg.header.total_size_bytes, msg.header.sha256)
                else:
                    part.write(msg.offset, msg.chunk)
                    failures = 0
                    if on_progress is not None:
                        on_progress(part.size, part.total)
            return part.finish(fmt, resumed_from)
        except grpc.RpcError as exc:
            err: LoradError = map_error(exc)
        except IncompleteDownloadError as exc:
            err = Unavailable(str(exc))  # a stream that ended early is resumed like a broken one
        except IntegrityError as exc:
            err = exc
        finally:
            part.close()
            cancel = getattr(stream, "cancel", None)
            if cancel is not None:
                cancel()  # no-op on a finished call; stops a stream abandoned after a local error
        if isinstance(err, IntegrityError | InvalidArgument) and offset > 0 and not restarted:
            # The .part file belongs to another version of the file (or is corrupt): start over once.
            log.info("download_restart file=%s reason=%s", part.final.name, type(err).__name__)
            part.discard()
            restarted, resumed_from = True, 0
            continue
        if isinstance(err, IntegrityError):
            part.discard()
        if not isinstance(err, Unavailable) or failures + 1 >= retry.max_attempts:
            raise err
        await asyncio.sleep(retry.delay(failures))
        failures += 1
