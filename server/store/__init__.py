"""SQLite store (WAL, versioned migrations): apps, samples, datasets, jobs, events, checkpoints, adapters, schedules."""

from lorad.server.store.adapters import AdapterRepo
from lorad.server.store.apps import AppRepo
from lorad.server.store.db import Database
from lorad.server.store.jobs import JobRepo
from lorad.server.store.samples import SampleRepo

__all__ = ["AdapterRepo", "AppRepo", "Database", "JobRepo", "SampleRepo"]
