"""Versioned schema migrations; append new versions, never edit applied ones."""

from __future__ import annotations

# (version, SQL statements separated by ';'). PRAGMA user_version holds the applied version.
MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE apps (
            app_id TEXT PRIMARY KEY,
            display_name TEXT NOT NULL,
            token_hash TEXT NOT NULL UNIQUE,
            created_at_ms INTEGER NOT NULL,
            revoked INTEGER NOT NULL DEFAULT 0,
            max_samples INTEGER NOT NULL,
            max_sample_bytes INTEGER NOT NULL,
            max_adapters INTEGER NOT NULL,
            max_active_jobs INTEGER NOT NULL
        );
        CREATE TABLE datasets (
            app_id TEXT NOT NULL REFERENCES apps(app_id),
            dataset_id TEXT NOT NULL,
            created_at_ms INTEGER NOT NULL,
            updated_at_ms INTEGER NOT NULL,
            PRIMARY KEY (app_id, dataset_id)
        );
        CREATE TABLE samples (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            sample_id TEXT NOT NULL UNIQUE,
            app_id TEXT NOT NULL,
            dataset_id TEXT NOT NULL,
            content_hash TEXT NOT NULL,
            body TEXT NOT NULL,
            size_bytes INTEGER NOT NULL,
            created_at_ms INTEGER NOT NULL,
            UNIQUE (app_id, dataset_id, content_hash),
            FOREIGN KEY (app_id, dataset_id) REFERENCES datasets(app_id, dataset_id)
        );
        CREATE INDEX samples_by_app ON samples(app_id);
        CREATE TABLE jobs (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id TEXT NOT NULL UNIQUE,
            app_id TEXT NOT NULL REFERENCES apps(app_id),
            request_id TEXT NOT NULL,
            spec_hash TEXT NOT NULL,
            spec TEXT NOT NULL,
            state TEXT NOT NULL,
            blocked TEXT NOT NULL DEFAULT '',
            blocked_detail TEXT NOT NULL DEFAULT '',
            progress TEXT NOT NULL DEFAULT '{}',
            error_code TEXT NOT NULL DEFAULT '',
            error_message TEXT NOT NULL DEFAULT '',
            adapter_id TEXT NOT NULL DEFAULT '',
            backend TEXT NOT NULL DEFAULT '',
            schedule_id TEXT NOT NULL DEFAULT '',
            created_at_ms INTEGER NOT NULL,
            started_at_ms INTEGER NOT NULL DEFAULT 0,
            finished_at_ms INTEGER NOT NULL DEFAULT 0,
            data_until_ms INTEGER NOT NULL,
            UNIQUE (app_id, request_id)
        );
        CREATE INDEX jobs_by_state ON jobs(state);
        CREATE TABLE job_events (
            event_id INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
            time_ms INTEGER NOT NULL,
            kind TEXT NOT NULL,
            state TEXT NOT NULL,
            blocked TEXT NOT NULL DEFAULT '',
            progress TEXT NOT NULL DEFAULT '{}',
            checkpoint TEXT NOT NULL DEFAULT '',
            message TEXT NOT NULL DEFAULT '',
            error_code TEXT NOT NULL DEFAULT '',
            error_message TEXT NOT NULL DEFAULT ''
        );
        CREATE INDEX events_by_job ON job_events(job_id, event_id);
        CREATE TABLE checkpoints (
            checkpoint_id TEXT PRIMARY KEY,
            job_id TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
            step INTEGER NOT NULL,
            created_at_ms INTEGER NOT NULL,
            size_bytes INTEGER NOT NULL,
            train_loss REAL NOT NULL,
            path TEXT NOT NULL
        );
        CREATE TABLE adapters (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            adapter_id TEXT NOT NULL UNIQUE,
            app_id TEXT NOT NULL REFERENCES apps(app_id),
            job_id TEXT NOT NULL,
            meta TEXT NOT NULL,
            created_at_ms INTEGER NOT NULL,
            size_bytes INTEGER NOT NULL,
            path TEXT NOT NULL
        );
        CREATE TABLE schedules (
            schedule_id TEXT PRIMARY KEY,
            app_id TEXT NOT NULL REFERENCES apps(app_id),
            spec TEXT NOT NULL,
            created_at_ms INTEGER NOT NULL
        )
        """,
    ),
]
