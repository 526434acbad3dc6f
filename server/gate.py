"""Orders an app's writes against a deletion of the same data, so nothing written mid-deletion outlives it.

DeleteDataset and ForgetApp first find what to delete (samples, the jobs that read them, the adapters those jobs
trained), then delete it step by step. A write for the same data in between would be missed: samples appended after
the last batch went but before the dataset row did (stored, counted against the quota, listed nowhere), a job created
after the jobs were read (its rows outlive "forget me"), a job starting from an adapter about to go. So a deletion
registers here first and waits for the conflicting writes in flight; until it ends, new conflicting writes are
refused with ABORTED and a message saying which deletion to wait for. DeleteAdapter registers too: a job created
from the adapter while it goes would fail at its start. Writes that cannot conflict go on: appending to another
dataset, a job that neither reads the dataset nor starts from the adapter being deleted.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lorad.server.errors import Aborted


class Write(enum.Enum):
    """What a write adds, which decides the deletions it conflicts with."""

    SAMPLES = "samples"  # to one dataset: conflicts with deleting that dataset, or the app's data
    JOB = "job"  # a job or schedule: conflicts with deleting a dataset it reads or the adapter it starts from
    ADAPTER = "adapter"  # an imported adapter: conflicts with forgetting the app only
    EXPORT = "export"  # a file built from an adapter (DownloadAdapter): conflicts with any deletion of the adapter


@dataclass(frozen=True, eq=False)
class _Write:
    app_id: str
    write: Write
    dataset_ids: tuple[str, ...]  # SAMPLES: the one appended to; JOB: those it reads
    adapter_id: str  # JOB: the adapter it starts from; EXPORT: the adapter exported


@dataclass(frozen=True, eq=False)  # identity equality: two equal deletions may run at once and leave separately
class _Deletion:
    app_id: str
    dataset_id: str = ""  # DeleteDataset
    with_adapters: bool = False  # DeleteDataset with delete_adapters: every adapter that learned from it goes too
    adapter_id: str = ""  # DeleteAdapter; neither: ForgetApp (all of the app's data)

    def conflicts(self, w: _Write) -> bool:
        if w.app_id != self.app_id:
            return False
        if self.dataset_id:
            if self.dataset_id in w.dataset_ids:
                return w.write in (Write.SAMPLES, Write.JOB)
            # Which adapters learned from the data is known only once the jobs on it stopped: any start from or
            # export of one waits (one that did not learn from it is refused for the seconds this takes).
            return w.write in (Write.JOB, Write.EXPORT) and self.with_adapters and bool(w.adapter_id)
        if self.adapter_id:
            return w.write in (Write.JOB, Write.EXPORT) and w.adapter_id == self.adapter_id
        return True

    def refusal(self, write: Write) -> Aborted:
        if write is Write.EXPORT and (self.dataset_id or self.adapter_id):
            what = (
                f"adapter {self.adapter_id!r} is being deleted (DeleteAdapter)"
                if self.adapter_id
                else f"dataset {self.dataset_id!r} is being deleted with the adapters that learned from it"
            )
            return Aborted(f"{what}; download again once that call returns")
        if self.dataset_id and write is Write.SAMPLES:
            return Aborted(
                f"dataset {self.dataset_id!r} is being deleted (DeleteDataset); samples sent once that call returns "
                "start a new dataset of that name"
            )
        if self.dataset_id:
            return Aborted(
                f"dataset {self.dataset_id!r} is being deleted (DeleteDataset), and this job or schedule reads it "
                "or may start from an adapter that learned from it; send this again once that call returns"
            )
        if self.adapter_id:
            return Aborted(
                f"adapter {self.adapter_id!r} is being deleted (DeleteAdapter), and this job or schedule starts "
                "from it; send this again once that call returns"
            )
        return Aborted(f"app {self.app_id!r} is being forgotten (ForgetApp); send this again once that returns")


class DeletionGate:
    """One per daemon: deletions register with ``deleting``, conflicting writes run inside ``writing``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deletions: list[_Deletion] = []
        self._writes: list[_Write] = []

    @contextmanager
    def deleting(
        self, app_id: str, *, dataset_id: str = "", with_adapters: bool = False, adapter_id: str = ""
    ) -> Iterator[None]:
        """Runs a deletion of ``dataset_id`` (and the adapters that learned from it, ``with_adapters``) or of
        ``adapter_id`` (neither: all the app's data) once no conflicting write is in flight; conflicting writes are
        refused until it ends. A write is one transaction, one import or one export build (a merged model: seconds).
        """
        d = _Deletion(app_id, dataset_id, with_adapters, adapter_id)
        try:
            with self._cond:
                self._deletions.append(d)
                self._cond.wait_for(lambda: not any(d.conflicts(w) for w in self._writes))
            yield
        finally:
            with self._cond:
                if d in self._deletions:
                    self._deletions.remove(d)

    @contextmanager
    def writing(
        self, app_id: str, write: Write, dataset_ids: tuple[str, ...] = (), adapter_id: str = ""
    ) -> Iterator[None]:
        """Runs a write of the app (samples to ``dataset_ids``; a job reading them, starting from ``adapter_id``; an
        export of ``adapter_id``) unless a deletion it conflicts with is running.

        Raises:
            Aborted: such a deletion is running (the message names it).
        """
        w = _Write(app_id, write, tuple(dataset_ids), adapter_id)
        with self._cond:
            for d in self._deletions:
                if d.conflicts(w):
                    raise d.refusal(write)
            self._writes.append(w)
        try:
            yield
        finally:
            with self._cond:
                self._writes.remove(w)
                self._cond.notify_all()
