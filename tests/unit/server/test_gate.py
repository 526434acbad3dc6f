"""DeletionGate: a deletion waits for the conflicting writes in flight, then refuses new ones until it ends; writes
that cannot touch the deleted data go on."""

from __future__ import annotations

import threading
import time

import pytest

from lorad.server.errors import Aborted
from lorad.server.gate import DeletionGate, Write


def _refused(gate: DeletionGate, app: str, write: Write, dataset: str = "", init: str = "") -> str:
    with pytest.raises(Aborted) as info, gate.writing(app, write, (dataset,) if dataset else (), adapter_id=init):
        pass
    return str(info.value)


def _allowed(gate: DeletionGate, app: str, write: Write, dataset: str = "", init: str = "") -> None:
    with gate.writing(app, write, (dataset,) if dataset else (), adapter_id=init):
        pass


def test_deleting_a_dataset_refuses_its_samples_and_the_jobs_reading_it() -> None:
    gate = DeletionGate()
    with gate.deleting("a", dataset_id="diary"):
        assert "dataset 'diary' is being deleted" in _refused(gate, "a", Write.SAMPLES, "diary")
        msg = _refused(gate, "a", Write.JOB, "diary")
        assert "'diary'" in msg and "job or schedule" in msg, msg
        _allowed(gate, "a", Write.JOB, "mail", init="adp_1")  # without delete_adapters no adapter goes
        _allowed(gate, "a", Write.SAMPLES, "mail")  # another dataset of the app
        _allowed(gate, "a", Write.ADAPTER)
        _allowed(gate, "b", Write.SAMPLES, "diary")  # another app's dataset of the same name
        _allowed(gate, "b", Write.JOB, "diary")
    _allowed(gate, "a", Write.SAMPLES, "diary")  # over: a new dataset of that name may start
    _allowed(gate, "a", Write.JOB, "diary")


def test_deleting_a_dataset_with_its_adapters_refuses_every_job_from_an_adapter() -> None:
    gate = DeletionGate()
    with gate.deleting("a", dataset_id="diary", with_adapters=True):
        _refused(gate, "a", Write.JOB, "mail", init="adp_1")  # the line is known only once its jobs stopped
        _allowed(gate, "a", Write.JOB, "mail")
        _allowed(gate, "b", Write.JOB, "mail", init="adp_1")


def test_forgetting_an_app_refuses_all_its_writes() -> None:
    gate = DeletionGate()
    with gate.deleting("a"):
        for write, ds in ((Write.SAMPLES, "x"), (Write.JOB, ""), (Write.ADAPTER, "")):
            assert "app 'a' is being forgotten" in _refused(gate, "a", write, ds)
        _allowed(gate, "b", Write.ADAPTER)
    _allowed(gate, "a", Write.ADAPTER)


def test_deleting_an_adapter_refuses_the_jobs_starting_from_it_only() -> None:
    gate = DeletionGate()
    with gate.deleting("a", adapter_id="adp_1"):
        msg = _refused(gate, "a", Write.JOB, "diary", init="adp_1")
        assert "adapter 'adp_1' is being deleted" in msg, msg
        _allowed(gate, "a", Write.JOB, "diary", init="adp_2")
        _allowed(gate, "a", Write.JOB, "diary")
        _allowed(gate, "a", Write.SAMPLES, "diary")
        _allowed(gate, "a", Write.ADAPTER)
        _allowed(gate, "b", Write.JOB, "diary", init="adp_1")
    _allowed(gate, "a", Write.JOB, "diary", init="adp_1")


def test_an_export_waits_for_no_deletion_but_its_adapters() -> None:
    gate = DeletionGate()
    with gate.deleting("a", adapter_id="adp_1"):
        assert "adapter 'adp_1' is being deleted" in _refused(gate, "a", Write.EXPORT, init="adp_1")
        _allowed(gate, "a", Write.EXPORT, init="adp_2")
    with gate.deleting("a", dataset_id="diary", with_adapters=True):
        assert "download again" in _refused(gate, "a", Write.EXPORT, init="adp_2")
    with gate.deleting("a", dataset_id="diary"):
        _allowed(gate, "a", Write.EXPORT, init="adp_2")
    with gate.deleting("a"):
        _refused(gate, "a", Write.EXPORT, init="adp_2")


def test_a_deletion_waits_for_the_conflicting_write_in_flight() -> None:
    gate = DeletionGate()
    writing, finish = threading.Event(), threading.Event()
    order: list[str] = []

    def write() -> None:
        with gate.writing("a", Write.SAMPLES, ("diary",)):
            writing.set()
            finish.wait(10)
            order.append("write")

    def delete() -> None:
        with gate.deleting("a", dataset_id="diary"):
            order.append("delete")

    w = threading.Thread(target=write)
    w.start()
    assert writing.wait(10)
    d = threading.Thread(target=delete)
    d.start()
    time.sleep(0.2)
    assert order == [], "the deletion started under a write of the same dataset"
    _refused(gate, "a", Write.SAMPLES, "diary")  # registered: new writes are refused while it waits
    _allowed(gate, "a", Write.SAMPLES, "mail")  # and one that cannot conflict neither waits nor is refused
    finish.set()
    w.join(10)
    d.join(10)
    assert order == ["write", "delete"]


def test_a_deletion_does_not_wait_for_writes_it_does_not_conflict_with() -> None:
    gate = DeletionGate()
    with gate.writing("a", Write.SAMPLES, ("mail",)), gate.writing("b", Write.JOB, ("diary",)):
        done = threading.Event()

        def delete() -> None:
            with gate.deleting("a", dataset_id="diary"):
                done.set()

        t = threading.Thread(target=delete)
        t.start()
        assert done.wait(10), "a deletion of 'diary' waited for a write to 'mail' or to another app"
        t.join(10)


def test_two_deletions_of_the_same_dataset_leave_separately() -> None:
    gate = DeletionGate()
    with gate.deleting("a", dataset_id="diary"):
        with gate.deleting("a", dataset_id="diary"):
            pass
        _refused(gate, "a", Write.SAMPLES, "diary")  # the outer one still runs
    _allowed(gate, "a", Write.SAMPLES, "diary")
