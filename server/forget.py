"""ForgetApp: cancel the app's jobs and delete its samples, datasets, checkpoints, adapters and schedules."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from lorad.server.jobs.files import remove_tree
from lorad.server.services import Services

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ForgetResult:
    """What was deleted."""

    deleted_samples: int
    deleted_adapters: int
    deleted_jobs: int
    freed_bytes: int


def forget_app(s: Services, app_id: str, remove_schedule: object = None) -> ForgetResult:
    """Deletes everything the app stored (the app stays registered; revoke it separately).

    Args:
        s: the services.
        app_id: the app (must exist).
        remove_schedule: callable(aps_id) that drops a schedule's window from the scheduler, if running.
    """
    s.apps.get(app_id)  # NotFound for an unknown app
    s.manager.cancel_all(app_id)
    adapters = s.adapters.all_for_app(app_id)
    for a in adapters:
        s.adapters.delete(app_id, a.adapter_id)
    for sid in s.schedules.delete_app(app_id):
        if callable(remove_schedule):
            remove_schedule(f"schedule:{sid}")
    jobs = s.jobs.delete_app_jobs(app_id)
    n, sample_bytes = s.samples.forget_app(app_id)
    freed = remove_tree(s.layout.app_dir(app_id)) + sample_bytes
    log.info("app_forgotten", app_id=app_id, samples=n, adapters=len(adapters), jobs=jobs, freed_bytes=freed)
    return ForgetResult(n, len(adapters), jobs, freed)
