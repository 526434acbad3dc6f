"""Data: an app's samples and datasets — append within the app's quota, list, delete."""

from __future__ import annotations

from collections.abc import Sequence

from lorad.server.gate import DeletionGate, Write
from lorad.server.records import AppendResult, Dataset, SampleBody, StoredSample
from lorad.server.store.apps import AppRepo
from lorad.server.store.samples import SampleRepo


class AppData:
    """An app's datasets; servicers call these instead of the store."""

    def __init__(self, apps: AppRepo, samples: SampleRepo, gate: DeletionGate) -> None:
        self._apps, self._samples, self._gate = apps, samples, gate

    def append(self, app_id: str, dataset_id: str, bodies: Sequence[SampleBody]) -> AppendResult:
        """Appends validated samples atomically, within the app's current quota.

        Raises:
            ResourceExhausted: the quota would be exceeded.
            Aborted: the dataset, or all the app's data, is being deleted.
        """
        with self._gate.writing(app_id, Write.SAMPLES, (dataset_id,)):
            return self._samples.append(app_id, dataset_id, bodies, self._apps.get(app_id).quota)

    def list_datasets(self, app_id: str, size: int, token: str) -> tuple[list[Dataset], str]:
        """One page of the app's datasets and the next page token."""
        return self._samples.list_datasets(app_id, size, token)

    def get_dataset(self, app_id: str, dataset_id: str) -> Dataset:
        """One dataset of the app (NotFound otherwise)."""
        return self._samples.get_dataset(app_id, dataset_id)

    def list_samples(self, app_id: str, dataset_id: str, size: int, token: str) -> tuple[list[StoredSample], str]:
        """One page of a dataset's samples and the next page token."""
        return self._samples.list_samples(app_id, dataset_id, size, token)

    def existing_datasets(self, app_id: str, dataset_ids: Sequence[str]) -> set[str]:
        """Which of ``dataset_ids`` the app has."""
        return self._samples.existing_datasets(app_id, dataset_ids)
