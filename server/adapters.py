"""Adapters: an app's finished adapters — list, read, export for download, delete with their files."""

from __future__ import annotations

from typing import BinaryIO

from lorad.server.exports import adapter_file
from lorad.server.gate import DeletionGate, Write
from lorad.server.jobs.files import Layout, remove_tree
from lorad.server.modelhost import ModelHost
from lorad.server.records import AdapterRec
from lorad.server.store.adapters import AdapterRepo


class AdapterLibrary:
    """An app's adapters; servicers call these instead of the store."""

    def __init__(
        self, repo: AdapterRepo, layout: Layout, models: ModelHost, gate: DeletionGate, export_cap_bytes: int = 0
    ) -> None:
        self._repo, self._layout, self._models, self._gate, self._cap = repo, layout, models, gate, export_cap_bytes

    def list_page(self, app_id: str, size: int, token: str) -> tuple[list[AdapterRec], str]:
        """One page of the app's adapters and the next page token."""
        return self._repo.list_page(app_id, size, token)

    def get(self, app_id: str, adapter_id: str) -> AdapterRec:
        """One adapter of the app (NotFound otherwise)."""
        return self._repo.get(app_id, adapter_id)

    def export(self, rec: AdapterRec, fmt: str) -> tuple[BinaryIO, int, str, str]:
        """The file for ``fmt``, built once and cached within the export-cache cap.

        Returns:
            (open file, size in bytes, sha256 hex, suggested name); the caller closes the file.

        Raises:
            NotFound: the adapter was deleted since ``rec`` was read.
            Aborted: a deletion of it is running (a file built now would outlive it).
        """
        with self._gate.writing(rec.app_id, Write.EXPORT, adapter_id=rec.adapter_id):
            self._repo.get(rec.app_id, rec.adapter_id)  # still there: building would recreate its folder
            return adapter_file(rec, fmt, self._models, self._layout, self._cap)

    def delete(self, app_id: str, adapter_id: str) -> int:
        """Deletes the adapter's record, then its files; returns the bytes freed."""
        rec = self._repo.delete(app_id, adapter_id)
        return remove_tree(self._layout.adapter_dir(app_id, rec.adapter_id))
