"""ImportAdapter: a PEFT tar made elsewhere becomes an adapter of the app, after size, digest and base checks."""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from lorad.server.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted
from lorad.server.gate import Write
from lorad.server.jobs.files import remove_tree, tree_size
from lorad.server.records import AdapterRec
from lorad.server.services import Services
from lorad.server.store.db import new_id, now_ms

log = structlog.get_logger(__name__)

MAX_IMPORT_BYTES = 256 * 1024 * 1024
MAX_CHUNK = 1024 * 1024
_ALLOWED = ("adapter_config.json", "adapter_model.safetensors", "lorad_metadata.json")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ImportHeader:
    """The first message of an import, checked."""

    base_model: str
    base_model_sha256: str
    total_size_bytes: int
    sha256: str


def check_header(base_model: str, base_sha: str, total: int, sha: str, s: Services) -> ImportHeader:
    """Validates the header fields (all problems of the first bad field named).

    Raises:
        InvalidArgument: a malformed hash, a size out of range or an unknown model.
    """
    if not _HEX64.fullmatch(base_sha):
        raise InvalidArgument("header.base_model_sha256", "must be 64 lowercase hex digits")
    if not _HEX64.fullmatch(sha):
        raise InvalidArgument("header.sha256", "must be 64 lowercase hex digits")
    if not 1 <= total <= MAX_IMPORT_BYTES:
        raise InvalidArgument("header.total_size_bytes", f"{total}: must be 1 to {MAX_IMPORT_BYTES}")
    s.models.entry(base_model, field="header.base_model")
    return ImportHeader(base_model, base_sha, total, sha)


class Upload:
    """Receives the chunks into a temp file under the app's directory, counting bytes and hashing."""

    def __init__(self, s: Services, app_id: str, header: ImportHeader) -> None:
        """Opens the temp file.

        Raises:
            Aborted: the app is being forgotten (its folder is going).
        """
        self.header = header
        base = s.layout.app_dir(app_id) / "imports"
        with s.gate.writing(app_id, Write.ADAPTER):  # refused before any byte is sent while the app is forgotten
            base.mkdir(parents=True, exist_ok=True)
            self.path = base / f".tmp-{new_id('imp')}.tar"
            self._f = self.path.open("wb")
        self._h = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        """Appends one chunk.

        Raises:
            InvalidArgument: a chunk above 1 MiB or more bytes than the header announced.
        """
        if len(chunk) > MAX_CHUNK:
            raise InvalidArgument("chunk", f"{len(chunk)} bytes: at most {MAX_CHUNK} per message")
        self.size += len(chunk)
        if self.size > self.header.total_size_bytes:
            raise InvalidArgument("chunk", f"more than header.total_size_bytes={self.header.total_size_bytes} sent")
        self._h.update(chunk)
        self._f.write(chunk)

    def finish(self) -> None:
        """Closes the file and checks size and digest.

        Raises:
            InvalidArgument: fewer bytes than announced or a digest mismatch.
        """
        self._f.close()
        if self.size != self.header.total_size_bytes:
            raise InvalidArgument(
                "chunk", f"{self.size} bytes received; header.total_size_bytes says {self.header.total_size_bytes}"
            )
        if self._h.hexdigest() != self.header.sha256:
            raise InvalidArgument("header.sha256", f"the received bytes hash to {self._h.hexdigest()[:16]}…")

    def discard(self) -> None:
        """Removes the temp file (always called)."""
        if not self._f.closed:
            self._f.close()
        self.path.unlink(missing_ok=True)


def _extract(tar_path: Path, dest: Path) -> None:
    """Extracts only the PEFT files (regular files, plain names); anything else is refused."""
    dest.mkdir(parents=True)
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            members = tar.getmembers()
            names = [m.name for m in members]
            bad = [n for m, n in zip(members, names, strict=True) if n not in _ALLOWED or not m.isfile()]
            if bad or len(set(names)) != len(names):
                raise InvalidArgument("chunk", f"the tar may hold only {list(_ALLOWED)} (found {bad[:3]})")
            for m in members:
                src = tar.extractfile(m)
                assert src is not None  # regular file
                (dest / m.name).write_bytes(src.read())
    except tarfile.TarError as exc:
        raise InvalidArgument("chunk", f"not an uncompressed tar ({type(exc).__name__})") from None


def store_import(s: Services, app_id: str, up: Upload) -> AdapterRec:
    """Checks the base and the PEFT files, then registers the adapter (files first, record last).

    Raises:
        ResourceExhausted: the app's adapter quota is full.
        FailedPrecondition: the adapter's base model hash differs from the header's or the daemon's model.
        InvalidArgument: not a PEFT adapter lorad can load.
        Aborted: the app is being forgotten, or was during the upload.
    """
    from lorad.server.engine.api import AdapterMetadata, load_adapter, portable_base_name, resolve

    quota = s.apps.get(app_id).quota
    if s.adapters.count(app_id) >= quota.max_adapters:
        raise ResourceExhausted(f"adapter quota: max_adapters={quota.max_adapters}; delete adapters first")
    h = up.header
    entry = s.models.entry(h.base_model, field="header.base_model")
    ck = resolve(entry.source, s.models.cache_root)
    if h.base_model_sha256 != ck.model_hash:
        raise FailedPrecondition(
            f"adapter is for base model {h.base_model_sha256[:16]}… but {entry.name} is "
            f"{ck.model_hash[:16]}…; import it on a device with that base"
        )
    with s.gate.writing(app_id, Write.ADAPTER):  # files and row, never half-way through a ForgetApp
        if not up.path.exists():  # a ForgetApp that ran during the upload removed it with the app's files
            raise Aborted(f"app {app_id!r} was forgotten while the adapter was uploading; send it again")
        adapter_id = new_id("adp")
        folder = s.layout.adapter_dir(app_id, adapter_id)
        peft = folder / "peft"
        try:
            _extract(up.path, peft)
            try:
                adapter = load_adapter(peft)
            except (ValueError, KeyError, OSError) as exc:
                raise InvalidArgument("chunk", f"not a loadable PEFT LoRA adapter: {str(exc)[:200]}") from None
            m = adapter.metadata
            if m is not None and m.base_model_hash != ck.model_hash:
                raise FailedPrecondition(
                    f"lorad_metadata.json names base {m.base_model_hash[:16]}…, not {ck.model_hash[:16]}…"
                )
            lora = adapter.lora
            meta = AdapterMetadata(
                base_model_hash=ck.model_hash,
                tokenizer_hash=ck.tokenizer_hash,
                rank=lora.rank,
                alpha=lora.alpha,
                targets=tuple(lora.targets),
                backend="imported",
                base_model_source=portable_base_name(entry.source),
            )
            from lorad.server.engine.api import METADATA_FILE

            (peft / METADATA_FILE).write_text(json.dumps(meta.to_json(), indent=2))
            rec = AdapterRec(
                adapter_id=adapter_id,
                app_id=app_id,
                job_id="",
                base_model=entry.name,
                base_model_sha256=ck.model_hash,
                tokenizer_sha256=ck.tokenizer_hash,
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                target_modules=tuple(lora.targets),
                steps=0,
                eval_loss_before=float("nan"),
                eval_loss_after=float("nan"),
                train_loss=float("nan"),
                precision_plan=(),
                data_until_ms=0,
                sample_count=0,
                created_at_ms=now_ms(),
                size_bytes=tree_size(peft),
                path=str(peft),
            )
            s.adapters.add(rec)
        except BaseException:
            remove_tree(folder)
            raise
    log.info("adapter_imported", adapter_id=adapter_id, rank=lora.rank, size_bytes=rec.size_bytes)
    return rec
