"""Adapter files for download: PEFT tar, GGUF LoRA and merged model, built once, atomically, with a sha256."""

from __future__ import annotations

import hashlib
import os
import tarfile
import threading
from pathlib import Path
from typing import BinaryIO

import structlog
from safetensors import SafetensorError

from lorad.server.disk import enforce_export_cap
from lorad.server.engine.api import atomic_write
from lorad.server.errors import FailedPrecondition
from lorad.server.jobs.files import Layout, remove_tree, scrub_paths
from lorad.server.modelhost import ModelHost
from lorad.server.records import AdapterRec

log = structlog.get_logger(__name__)
CHUNK = 1024 * 1024  # DownloadAdapter chunks are at most 1 MiB
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _tar_dir(src: Path, dest: Path) -> None:
    def write(out: BinaryIO) -> None:
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for p in sorted(src.iterdir(), key=lambda p: p.name):
                # Fixed metadata so the same files always give the same bytes (and sha256): no time, owner or
                # umask-dependent mode from this device.
                info = tar.gettarinfo(str(p), arcname=p.name)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                info.mode = 0o644
                info.pax_headers = {}
                with p.open("rb") as f:
                    tar.addfile(info, f)

    atomic_write(dest, write, tmp_prefix=".tmp-")


def _gguf(rec: AdapterRec, models: ModelHost, dest: Path) -> None:
    from lorad.server.engine.api import export_gguf_lora, load_adapter, read_config, resolve

    entry = models.entry(rec.base_model, field="adapter_id")
    ck = resolve(entry.source, models.cache_root)
    # export_gguf_lora writes crash-safely itself (temp, fsync, rename).
    export_gguf_lora(load_adapter(Path(rec.path)), dest, read_config(ck.path), name=f"lorad {rec.adapter_id}")


def _merged(rec: AdapterRec, models: ModelHost, dest: Path) -> None:
    from lorad.server.engine.api import export_merged, load_adapter, resolve

    entry = models.entry(rec.base_model, field="adapter_id")
    ck = resolve(entry.source, models.cache_root)
    adapter = load_adapter(Path(rec.path))
    adapter.check_base(ck.model_hash, ck.tokenizer_hash)
    folder = dest.with_name(f"{dest.name}.d")
    export_merged(ck.path, adapter, folder)
    try:
        _tar_dir(folder, dest)
    finally:
        remove_tree(folder)


def adapter_file(
    rec: AdapterRec, fmt: str, models: ModelHost, layout: Layout | None = None, cap_bytes: int = 0
) -> tuple[BinaryIO, int, str, str]:
    """The file for ``fmt`` ("peft", "gguf", "merged"), built on first request and cached next to the adapter.

    The file is opened under its lock, so evicting it later (the export-cache cap, gc) cannot pull it away from
    this download. With ``layout`` and ``cap_bytes`` > 0, building a new file first evicts least recently served
    exports of all apps so they stay below ``cap_bytes``.

    Returns:
        (open file, size in bytes, sha256 hex, suggested filename); the caller closes the file.

    Raises:
        FailedPrecondition: the base model needed for an export is not available.
    """
    base = Path(rec.path).parent / "exports"
    base.mkdir(parents=True, exist_ok=True)
    name = {
        "peft": f"{rec.adapter_id}.peft.tar",
        "gguf": f"{rec.adapter_id}.lora.gguf",
        "merged": f"{rec.adapter_id}.merged.tar",
    }[fmt]
    dest = base / name
    digest = dest.with_name(name + ".sha256")
    built = False
    with _lock(str(dest)):
        if dest.exists() and digest.exists() and _sha256(dest) != digest.read_text().strip():
            # A cached export that no longer matches its digest (bit rot, a torn copy) is rebuilt, never served.
            log.warning("export_cache_corrupt", fmt=fmt)
            dest.unlink()
        if not dest.exists() or not digest.exists():
            built = True
            try:
                if fmt == "peft":
                    _tar_dir(Path(rec.path), dest)
                elif fmt == "gguf":
                    _gguf(rec, models, dest)
                else:
                    _merged(rec, models, dest)
            except FileNotFoundError as exc:
                raise FailedPrecondition(
                    f"cannot export {fmt}: a file of base model {rec.base_model!r} is missing "
                    f"({scrub_paths(str(exc))}); ask the device owner to reinstall the model"
                ) from None
            except (SafetensorError, ValueError, KeyError) as exc:  # torn or tampered adapter files on disk
                raise FailedPrecondition(
                    f"cannot export {fmt}: adapter {rec.adapter_id} is corrupt on disk "
                    f"({type(exc).__name__}); delete it and train again"
                ) from None
            atomic_write(digest, lambda f: f.write(_sha256(dest).encode()), tmp_prefix=".tmp-")
        os.utime(dest)  # the cap evicts the least recently served first
        fh = dest.open("rb")
        size, sha = os.fstat(fh.fileno()).st_size, digest.read_text().strip()
    if built and layout is not None:
        enforce_export_cap(layout, cap_bytes, dest, _lock)
    return fh, size, sha, name
