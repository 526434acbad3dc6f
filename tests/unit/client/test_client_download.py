"""download_adapter: sha256/size verification, resume after a cut-off stream or a dead process, atomic placement."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import lorad.client as lc
from tests.fixtures.fake_daemon import CHUNK, FAST_RETRY, FakeDaemon


def client(fake: FakeDaemon, retry: lc.RetryPolicy = FAST_RETRY) -> lc.Client:
    return lc.Client(fake.target, fake.app_token("notes"), retry=retry, timeout=5)


def test_download_verifies_and_places_file(fake: FakeDaemon, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    with client(fake) as c:
        r = c.download_adapter("ad_1", tmp_path / "a.tar", on_progress=lambda n, total: seen.append((n, total)))
    blob = fake.state.adapter_blob
    assert Path(r.path).read_bytes() == blob
    assert r.sha256 == hashlib.sha256(blob).hexdigest() and r.size_bytes == len(blob) and r.resumed_from == 0
    assert not (tmp_path / "a.tar.part").exists()
    assert seen[-1] == (len(blob), len(blob)) and len(seen) == -(-len(blob) // CHUNK)


def test_cut_off_stream_is_resumed_from_the_received_offset(fake: FakeDaemon, tmp_path: Path) -> None:
    fake.state.download_cut_after_chunks = [3, 4]  # two breaks: after 3 chunks, then after 4 more
    with client(fake) as c:
        r = c.download_adapter("ad_1", tmp_path / "a.tar")
    assert fake.state.download_offsets == [0, 3 * CHUNK, 7 * CHUNK]
    assert Path(r.path).read_bytes() == fake.state.adapter_blob


def test_interrupted_process_resumes_from_part_file(fake: FakeDaemon, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar"
    fake.state.download_cut_after_chunks = [5]
    with client(fake, lc.RetryPolicy(max_attempts=1)) as c, pytest.raises(lc.Unavailable):
        c.download_adapter("ad_1", dest)
    # Nothing is in place; the verified-so-far prefix waits in the .part file.
    assert not dest.exists() and (tmp_path / "a.tar.part").stat().st_size == 5 * CHUNK
    with client(fake) as c:
        r = c.download_adapter("ad_1", dest)
    assert fake.state.download_offsets[-1] == 5 * CHUNK and r.resumed_from == 5 * CHUNK
    assert dest.read_bytes() == fake.state.adapter_blob


def test_digest_mismatch_discards_and_never_places(fake: FakeDaemon, tmp_path: Path) -> None:
    fake.state.adapter_sha_override = "0" * 64
    with client(fake) as c, pytest.raises(lc.IntegrityError, match="sha256"):
        c.download_adapter("ad_1", tmp_path / "a.tar")
    assert list(tmp_path.iterdir()) == []


def test_stale_part_file_from_another_version_restarts_once(fake: FakeDaemon, tmp_path: Path) -> None:
    (tmp_path / "a.tar.part").write_bytes(b"x" * 2 * CHUNK)  # same length prefix, wrong bytes
    with client(fake) as c:
        r = c.download_adapter("ad_1", tmp_path / "a.tar")
    assert fake.state.download_offsets == [2 * CHUNK, 0] and r.resumed_from == 0
    assert Path(r.path).read_bytes() == fake.state.adapter_blob


def test_part_file_longer_than_the_file_restarts(fake: FakeDaemon, tmp_path: Path) -> None:
    (tmp_path / "a.tar.part").write_bytes(b"x" * (len(fake.state.adapter_blob) + 5))
    with client(fake) as c:
        r = c.download_adapter("ad_1", tmp_path / "a.tar")
    assert Path(r.path).read_bytes() == fake.state.adapter_blob


def test_directory_destination_uses_suggested_name_and_refuses_overwrite(fake: FakeDaemon, tmp_path: Path) -> None:
    with client(fake) as c:
        r = c.download_adapter("ad_7", tmp_path)
        assert Path(r.path) == tmp_path / "ad_7.peft.tar"
        with pytest.raises(lc.AlreadyExists, match="--force"):
            c.download_adapter("ad_7", tmp_path)
        c.download_adapter("ad_7", tmp_path, overwrite=True)


def test_download_by_job_resolves_adapter_or_says_why_not(fake: FakeDaemon, tmp_path: Path) -> None:
    from lorad.v1 import jobs_pb2

    with client(fake) as c:
        job = c.create_job(["d"])
        with pytest.raises(lc.FailedPrecondition, match="queued"):
            c.download_adapter(job, tmp_path / "x")
        fake.call(fake.jobs.add_event, job.job_id, jobs_pb2.JOB_STATE_SUCCEEDED, 1, 1, 0.1)
        r = c.download_adapter(job.job_id, tmp_path / "x", format="gguf")
    assert r.format is lc.AdapterFormat.GGUF and Path(r.path).stat().st_size == len(fake.state.adapter_blob)


def test_unknown_adapter_is_not_found(fake: FakeDaemon, tmp_path: Path) -> None:
    with client(fake) as c, pytest.raises(lc.NotFound):
        c.download_adapter("zz", tmp_path / "x")
    assert not (tmp_path / "x.part").exists() or (tmp_path / "x.part").stat().st_size == 0


def test_stale_job_object_is_refreshed_after_it_succeeded(fake: FakeDaemon, tmp_path: Path) -> None:
    # The README's flow: create_job's snapshot says "queued"; after watch ended the job has succeeded.
    from lorad.v1 import jobs_pb2

    with client(fake) as c:
        job = c.create_job(["d"])
        fake.call(fake.jobs.add_event, job.job_id, jobs_pb2.JOB_STATE_SUCCEEDED, 1, 1, 0.1)
        assert job.adapter_id == ""  # still the old snapshot
        r = c.download_adapter(job, tmp_path / "adapter.tar")
    assert Path(r.path).read_bytes() == fake.state.adapter_blob


def test_concurrent_pulls_to_one_path_leave_one_verified_file(fake: FakeDaemon, tmp_path: Path) -> None:
    import threading

    fake.state.download_chunk_delay_s = 0.01  # ~0.1 s per download: the two overlap
    dest = tmp_path / "a.tar"
    start = threading.Barrier(2)
    outcomes: list[object] = []

    def pull(overwrite: bool) -> None:
        with client(fake) as c:
            start.wait()
            try:
                outcomes.append(c.download_adapter("ad_1", dest, overwrite=overwrite))
            except lc.LoradError as exc:
                outcomes.append(exc)

    for overwrite in (False, True):
        outcomes.clear()
        dest.unlink(missing_ok=True)
        threads = [threading.Thread(target=pull, args=(overwrite,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        results = [o for o in outcomes if isinstance(o, lc.DownloadResult)]
        errors = [o for o in outcomes if not isinstance(o, lc.DownloadResult)]
        # Without overwrite the second pull finds the first one's file; with it, both succeed one after the other.
        assert len(results) == (2 if overwrite else 1), outcomes
        assert all(isinstance(e, lc.AlreadyExists) for e in errors)
        assert dest.read_bytes() == fake.state.adapter_blob
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar"]  # no .part or .lock left behind


def test_path_ending_in_a_slash_is_a_directory_created_on_demand(fake: FakeDaemon, tmp_path: Path) -> None:
    with client(fake) as c:
        r = c.download_adapter("ad_3", f"{tmp_path}/new/dir/")
    assert Path(r.path) == tmp_path / "new" / "dir" / "ad_3.peft.tar"
    assert Path(r.path).read_bytes() == fake.state.adapter_blob
