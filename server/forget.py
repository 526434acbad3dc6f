"""ForgetApp, DeleteDataset and DeleteAdapter: stop the jobs on the data, delete every row and file derived from it,
durably; what depends on it is named (or cancelled with it), never left to fail later.

Order, so a crash, a full disk or a concurrent call never leaves derived data behind: (1) record the intent (a marker
file, finished at the next start if we die) and register with the gate (the app's writes to the same data are refused
until the end, ``gate.py``), (2) bar the jobs from the NPU and wait for the worker thread to leave them (no
checkpoint is written after; the line of jobs is read again once they are stopped), (3) delete files (frees space),
(4) delete rows in small transactions, (5) clear the marker.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from lorad.server import intents
from lorad.server.errors import FailedPrecondition, LoradError, NotFound, Unavailable
from lorad.server.jobs.files import remove_tree, tree_size
from lorad.server.records import ACTIVE_STATES, Job, JobState
from lorad.server.services import Services
from lorad.server.store.purge import Purger

log = structlog.get_logger(__name__)

RemoveWindow = Callable[[str], None]
DATASET, DATASET_AND_ADAPTERS = "dataset", "dataset+adapters"  # the intent kinds of DeleteDataset


@dataclass(frozen=True)
class DatasetDeleted:
    """What DeleteDataset deleted."""

    deleted_samples: int
    deleted_adapters: int


@dataclass(frozen=True)
class ForgetResult:
    """What was deleted."""

    deleted_samples: int
    deleted_adapters: int
    deleted_jobs: int
    freed_bytes: int


def _purger(s: Services) -> Purger:
    return Purger(s.db, s.reserve.release)


def _remove_windows(remove_window: RemoveWindow | None, aps_ids: list[str]) -> None:
    if remove_window is None:
        return
    for aps_id in aps_ids:
        try:
            remove_window(aps_id)
        except Exception as exc:  # the scheduler's own store may be on the full disk; a stale window fires once
            log.warning("window_remove_failed", error=type(exc).__name__)


def _stop(s: Services, app_id: str, job_ids: list[str] | None) -> None:
    timeout = s.cfg.server.checkpoint_timeout_seconds
    if not s.runner.stop_for_purge(app_id, job_ids, timeout):
        s.runner.release(app_id, job_ids)
        raise Unavailable(
            f"the training job did not stop within {timeout:g} s; retry (the deletion is recorded "
            "and finishes at the next start otherwise)"
        )


def forget_app(s: Services, app_id: str, remove_window: RemoveWindow | None = None) -> ForgetResult:
    """Deletes everything the app stored (the app stays registered; revoke it separately).

    Raises:
        NotFound: unknown app.
        Unavailable: its running job did not stop in time (the forget finishes at the next start).
    """
    s.apps.get(app_id)  # NotFound for an unknown app
    marker = intents.record(s.layout.data_dir, "forget", app_id)
    r = finish_forget(s, app_id, remove_window)
    intents.clear(marker)
    s.reserve.ensure()
    return r


def finish_forget(s: Services, app_id: str, remove_window: RemoveWindow | None = None) -> ForgetResult:
    """The body of ForgetApp (also run at start for an interrupted one); idempotent. The app's writes are refused
    while it runs (``gate``)."""
    with s.gate.deleting(app_id):
        return _forget(s, app_id, remove_window)


def _forget(s: Services, app_id: str, remove_window: RemoveWindow | None) -> ForgetResult:
    _stop(s, app_id, None)
    try:
        more = s.jobs.all_ids(app_id)
        scheds = [x.schedule_id for x in s.schedules.for_app(app_id)]
        _remove_windows(remove_window, [f"schedule:{x}" for x in scheds] + [f"window:{j}" for j in more])
        adapters = s.adapters.all_for_app(app_id)
        app_dir = s.layout.app_dir(app_id)
        freed = tree_size(app_dir)
        # Checkpoints, job plans, adapters, exports: files first, they free the space. The shared precision-plan cache
        # stays: plans are measured on a fixed calibration text, never on an app's data.
        remove_tree(app_dir)
        for hook in s.on_forget:
            hook(app_id)
        p = _purger(s)
        _, sample_bytes = s.samples.usage(app_id)
        n = p.samples(app_id)
        p.execute("DELETE FROM datasets WHERE app_id=?", (app_id,))
        p.execute("DELETE FROM schedules WHERE app_id=?", (app_id,))
        p.execute("DELETE FROM adapters WHERE app_id=?", (app_id,))
        p.job_rows(more)
        p.finish()
    finally:
        s.runner.release(app_id, None)
    freed += sample_bytes
    log.info("app_forgotten", samples=n, adapters=len(adapters), jobs=len(more), freed_bytes=freed)
    return ForgetResult(n, len(adapters), len(more), freed)


@dataclass(frozen=True)
class Lineage:
    """What learned from a dataset: ``jobs`` read it, or started from one of ``adapter_ids`` (``init_adapter_id``);
    ``adapter_ids`` are the adapters those jobs trained."""

    jobs: list[Job]
    adapter_ids: frozenset[str]


def _used_by(what: str, jobs: list[Job], scheds: list[str]) -> FailedPrecondition:
    names = [f"job {j.job_id} ({j.state.name})" for j in jobs] + [f"schedule {x}" for x in scheds]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return FailedPrecondition(
        f"{what} is used by {shown}; cancel the jobs and delete the schedules first, or pass cancel_dependents=true "
        "(CLI: --cancel-dependents) to cancel them with it"
    )


def lineage(s: Services, app_id: str, dataset_id: str, *, through_adapters: bool) -> Lineage:
    """The app's jobs that read ``dataset_id``, and with ``through_adapters`` also every job down the
    ``init_adapter_id`` line from their adapters, and so on. Found from job rows alone (a job row names the adapter it
    trained), so a deletion interrupted after some adapter rows went finds the same line again."""
    jobs = s.jobs.of_app(app_id)
    learned = {j.job_id for j in jobs if dataset_id in j.spec.dataset_ids}
    adapter_ids: set[str] = set()
    while through_adapters:
        found = {j.adapter_id for j in jobs if j.job_id in learned and j.adapter_id} - adapter_ids
        if not found:
            break
        adapter_ids |= found
        learned |= {j.job_id for j in jobs if j.spec.init_adapter_id in found}
    return Lineage([j for j in jobs if j.job_id in learned], frozenset(adapter_ids))


def dependents(s: Services, app_id: str, line: Lineage, dataset_id: str = "") -> tuple[list[Job], list[str]]:
    """The unfinished jobs of ``line`` and the app's schedules that read ``dataset_id`` (if given) or start from one
    of its adapters: what deleting the dataset (and the line's adapters) cancels."""
    jobs = [j for j in line.jobs if j.state in ACTIVE_STATES]
    scheds = [
        x.schedule_id
        for x in s.schedules.for_app(app_id)
        if (dataset_id and dataset_id in x.spec.dataset_ids) or x.spec.init_adapter_id in line.adapter_ids
    ]
    return jobs, scheds


def delete_dataset(
    s: Services,
    app_id: str,
    dataset_id: str,
    *,
    cancel_dependents: bool = False,
    remove_window: RemoveWindow | None = None,
    delete_adapters: bool = False,
) -> DatasetDeleted:
    """Deletes a dataset, its samples and the checkpoints of every job that read it. With ``delete_adapters`` it
    deletes every adapter that learned from it too (``lineage``), and treats the jobs and schedules that start from
    those adapters like readers of the data: their checkpoints go, unfinished ones are cancelled. Without it those
    adapters stay (they are the app's product; DeleteAdapter or ForgetApp removes them).

    Raises:
        NotFound: absent or another app's dataset.
        FailedPrecondition: an unfinished job or a schedule depends on it and ``cancel_dependents`` is false.
    """
    s.samples.get_dataset(app_id, dataset_id)
    # No job or schedule on the data appears between the check and the deletion.
    with s.gate.deleting(app_id, dataset_id=dataset_id, with_adapters=delete_adapters):
        line = lineage(s, app_id, dataset_id, through_adapters=delete_adapters)
        jobs, scheds = dependents(s, app_id, line, dataset_id)
        if (jobs or scheds) and not cancel_dependents:
            raise _used_by(f"dataset {dataset_id!r}", jobs, scheds)
        kind = DATASET_AND_ADAPTERS if delete_adapters else DATASET
        marker = intents.record(s.layout.data_dir, kind, app_id, dataset_id)
        r = _delete_dataset(s, app_id, dataset_id, remove_window, delete_adapters=delete_adapters)
    intents.clear(marker)
    s.reserve.ensure()
    return r


def finish_delete_dataset(
    s: Services,
    app_id: str,
    dataset_id: str,
    remove_window: RemoveWindow | None = None,
    *,
    delete_adapters: bool = False,
) -> DatasetDeleted:
    """The body of DeleteDataset (also run at start for an interrupted one); idempotent. Appends to the dataset and
    the app's new jobs and schedules are refused while it runs (``gate``)."""
    with s.gate.deleting(app_id, dataset_id=dataset_id, with_adapters=delete_adapters):
        return _delete_dataset(s, app_id, dataset_id, remove_window, delete_adapters=delete_adapters)


def _stopped_lineage(
    s: Services, app_id: str, dataset_id: str, barred: list[str], *, through_adapters: bool
) -> Lineage:
    """The line once every job in it is off the worker thread (each one stopped is added to ``barred``). A reader that
    finished between reading the line and stopping it trained an adapter the first read did not see, and jobs may
    start from that one: read the line again until stopping finds nobody new; then nothing in it can finish."""
    while True:
        line = lineage(s, app_id, dataset_id, through_adapters=through_adapters)
        new = [j.job_id for j in line.jobs if j.job_id not in barred]
        if not new:
            return line
        _stop(s, app_id, new)
        barred.extend(new)


def _delete_dataset(
    s: Services, app_id: str, dataset_id: str, remove_window: RemoveWindow | None, *, delete_adapters: bool
) -> DatasetDeleted:
    ids: list[str] = []  # the jobs barred from the worker thread, released at the end
    try:
        line = _stopped_lineage(s, app_id, dataset_id, ids, through_adapters=delete_adapters)
        readers = line.jobs
        _, scheds = dependents(s, app_id, line, dataset_id)
        adapters = sorted(a.adapter_id for a in s.adapters.all_for_app(app_id) if a.adapter_id in line.adapter_ids)
        p = _purger(s)
        for a in adapters:  # files first (they free the space), then the row
            remove_tree(s.layout.adapter_dir(app_id, a))
            p.execute("DELETE FROM adapters WHERE adapter_id=?", (a,))
        for j in readers:
            remove_tree(s.layout.job_dir(app_id, j.job_id))  # checkpoints and plans trained on the data
            why = f"dataset {dataset_id} deleted"
            if dataset_id not in j.spec.dataset_ids:
                why += f" (the job starts from adapter {j.spec.init_adapter_id}, which learned from it)"
            if j.state in ACTIVE_STATES:
                with contextlib.suppress(LoradError):
                    p.write(
                        functools.partial(
                            s.jobs.transition,
                            j.job_id,
                            ACTIVE_STATES,
                            JobState.CANCELLED,
                            message=f"cancelled: {why}",
                        )
                    )
            p.execute("DELETE FROM checkpoints WHERE job_id=?", (j.job_id,))
        _remove_windows(remove_window, [f"schedule:{x}" for x in scheds] + [f"window:{j}" for j in ids])
        for x in scheds:
            p.execute("DELETE FROM schedules WHERE schedule_id=?", (x,))
        n = p.samples(app_id, dataset_id)
        p.execute("DELETE FROM datasets WHERE app_id=? AND dataset_id=?", (app_id, dataset_id))
        p.finish()
    finally:
        s.runner.release(app_id, ids)
    for hook in s.on_adapters_deleted:
        hook(adapters)
    s.hub.notify()
    log.info("dataset_deleted", samples=n, jobs=len(ids), schedules=len(scheds), adapters=len(adapters))
    return DatasetDeleted(n, len(adapters))


def delete_adapter(
    s: Services,
    app_id: str,
    adapter_id: str,
    *,
    cancel_dependents: bool = False,
    remove_window: RemoveWindow | None = None,
) -> int:
    """Deletes an adapter and its files; returns the bytes freed. The unfinished jobs and the schedules that start
    from it (``init_adapter_id``) depend on it: without it they would fail at their start, every night for a
    schedule. With ``cancel_dependents`` those jobs are cancelled (their checkpoints go) and the schedules deleted.
    The jobs that finished from it and their adapters stay.

    Raises:
        NotFound: absent or another app's adapter.
        FailedPrecondition: an unfinished job or a schedule starts from it and ``cancel_dependents`` is false.
    """
    s.library.get(app_id, adapter_id)
    with s.gate.deleting(app_id, adapter_id=adapter_id):  # no job or schedule from it appears meanwhile
        starting = [j for j in s.jobs.of_app(app_id) if j.spec.init_adapter_id == adapter_id]
        jobs, scheds = dependents(s, app_id, Lineage(starting, frozenset({adapter_id})))
        if (jobs or scheds) and not cancel_dependents:
            raise _used_by(f"adapter {adapter_id!r}", jobs, scheds)
        for j in jobs:
            with contextlib.suppress(FailedPrecondition):  # it finished meanwhile
                s.manager.cancel(app_id, j.job_id, message=f"cancelled: adapter {adapter_id} it starts from deleted")
        _remove_windows(remove_window, [f"schedule:{x}" for x in scheds] + [f"window:{j.job_id}" for j in jobs])
        for x in scheds:
            with contextlib.suppress(NotFound):  # a DeleteSchedule got there first
                s.schedules.delete(x, app_id)
        freed = s.library.delete(app_id, adapter_id)
    for hook in s.on_adapters_deleted:
        hook((adapter_id,))
    log.info("adapter_deleted", jobs=len(jobs), schedules=len(scheds), freed_bytes=freed)
    return freed


def resume_pending(s: Services, remove_window: RemoveWindow | None = None) -> int:
    """Finishes every deletion an earlier run recorded but did not complete (called at start); returns how many."""
    done = 0
    for marker, kind, ids in intents.pending(s.layout.data_dir):
        try:
            if kind == "forget" and len(ids) == 1:
                finish_forget(s, ids[0], remove_window)
            elif kind in (DATASET, DATASET_AND_ADAPTERS) and len(ids) == 2:
                finish_delete_dataset(s, ids[0], ids[1], remove_window, delete_adapters=kind == DATASET_AND_ADAPTERS)
            else:
                log.warning("intent_unknown", kind=kind)
        except LoradError as exc:
            log.warning("intent_not_finished", kind=kind, error=str(exc)[:200])
            continue
        intents.clear(marker)
        log.info("intent_finished", kind=kind)
        done += 1
    s.reserve.ensure()
    return done
