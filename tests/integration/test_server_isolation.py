"""Two apps over every RPC: another app's resources are indistinguishable from absent ones; revocation; forget."""

from __future__ import annotations

import grpc
import pytest

from lorad.v1 import adapters_pb2, common_pb2, data_pb2, device_pb2, inference_pb2, jobs_pb2
from tests.integration.helpers import FINAL, append, code_of, create_job, tiny_config, wait_state

pytestmark = pytest.mark.integration
NF = grpc.StatusCode.NOT_FOUND


def _same_not_found(call, real_id: str, fake_id: str) -> None:
    """Calling with another app's id and with an absent id gives the same code and the same message."""
    c1, m1, _ = code_of(lambda: call(real_id))
    c2, m2, _ = code_of(lambda: call(fake_id))
    assert c1 == c2 == NF
    assert m1.replace(real_id, "ID") == m2.replace(fake_id, "ID")


def test_two_apps_are_isolated_over_every_rpc(make_daemon) -> None:
    d = make_daemon()
    a, _ = d.register("app-a")
    b, _ = d.register("app-b")
    append(a)
    job = create_job(a, steps=2)
    job = wait_state(a, job.job_id, FINAL)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.error
    sched = a.jobs.CreateSchedule(jobs_pb2.CreateScheduleRequest(
        dataset_ids=["notes"], config=tiny_config(), window=common_pb2.TrainingWindow(cron="30 2 * * *")),
        metadata=a.md).schedule  # fmt: skip
    jid, aid, sid = job.job_id, job.adapter_id, sched.schedule_id
    fake_j, fake_a, fake_s = "job_000000000000deadbeef", "adp_000000000000deadbeef", "sch_000000000000deadbeef"
    md = b.md

    # DataService
    _same_not_found(lambda x: b.data.GetDataset(data_pb2.GetDatasetRequest(dataset_id=x), metadata=md), "notes", "nope")
    _same_not_found(
        lambda x: b.data.ListSamples(data_pb2.ListSamplesRequest(dataset_id=x), metadata=md), "notes", "nope"
    )
    _same_not_found(lambda x: b.data.DeleteDataset(data_pb2.DeleteDatasetRequest(dataset_id=x), metadata=md), "notes",
                    "nope")  # fmt: skip
    assert list(b.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=md).datasets) == []
    code, _, _ = code_of(lambda: b.data.ForgetApp(data_pb2.ForgetAppRequest(app_id="app-a"), metadata=md))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    # JobService
    for rpc, req in ((b.jobs.GetJob, jobs_pb2.GetJobRequest), (b.jobs.PauseJob, jobs_pb2.PauseJobRequest),
                     (b.jobs.ResumeJob, jobs_pb2.ResumeJobRequest), (b.jobs.CancelJob, jobs_pb2.CancelJobRequest),
                     (b.jobs.ListJobEvents, jobs_pb2.ListJobEventsRequest),
                     (b.jobs.ListCheckpoints, jobs_pb2.ListCheckpointsRequest)):  # fmt: skip
        _same_not_found(lambda x, rpc=rpc, req=req: rpc(req(job_id=x), metadata=md), jid, fake_j)
    _same_not_found(lambda x: list(b.jobs.WatchJob(jobs_pb2.WatchJobRequest(job_id=x), metadata=md)), jid, fake_j)
    _same_not_found(lambda x: b.jobs.DeleteSchedule(jobs_pb2.DeleteScheduleRequest(schedule_id=x), metadata=md), sid,
                    fake_s)  # fmt: skip
    assert list(b.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=md).jobs) == []
    assert list(b.jobs.ListSchedules(jobs_pb2.ListSchedulesRequest(), metadata=md).schedules) == []
    code, msg, _ = code_of(lambda: create_job(b, request_id="x"))
    assert code == NF and "notes" in msg
    # AdapterService and InferenceService
    _same_not_found(lambda x: b.adapters.GetAdapter(adapters_pb2.GetAdapterRequest(adapter_id=x), metadata=md), aid,
                    fake_a)  # fmt: skip
    _same_not_found(lambda x: list(b.adapters.DownloadAdapter(adapters_pb2.DownloadAdapterRequest(adapter_id=x),
                                                              metadata=md)), aid, fake_a)  # fmt: skip
    _same_not_found(lambda x: b.adapters.DeleteAdapter(adapters_pb2.DeleteAdapterRequest(adapter_id=x), metadata=md),
                    aid, fake_a)  # fmt: skip
    _same_not_found(lambda x: list(b.inference.Generate(inference_pb2.GenerateRequest(adapter_id=x, text="hi"),
                                                        metadata=md)), aid, fake_a)  # fmt: skip
    assert list(b.adapters.ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=md).adapters) == []
    # DeviceService: B sees no job of A's.
    st = b.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=md)
    assert st.current_job_id == ""

    # Same names live in separate namespaces: B's "notes" and request id "r1" do not touch A's.
    append(b)
    jb = create_job(b, request_id="r1", steps=2)
    assert jb.job_id != jid
    ds_a = a.data.GetDataset(data_pb2.GetDatasetRequest(dataset_id="notes"), metadata=a.md).dataset
    assert ds_a.sample_count == 36
    wait_state(b, jb.job_id, FINAL)
    # A still has everything.
    assert a.jobs.GetJob(jobs_pb2.GetJobRequest(job_id=jid), metadata=a.md).job.adapter_id == aid

    # Revocation is immediate.
    d.owner().apps.RevokeApp(__import__("lorad.v1.apps_pb2", fromlist=["x"]).RevokeAppRequest(app_id="app-b"),
                             metadata=d.owner().md)  # fmt: skip
    code, _, _ = code_of(lambda: b.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=md))
    assert code == grpc.StatusCode.UNAUTHENTICATED

    # ForgetApp (owner) removes A's samples, adapters and files from disk.
    app_dir = d.data_dir / "apps" / "app-a"
    assert app_dir.exists()
    owner = d.owner()
    r = owner.data.ForgetApp(data_pb2.ForgetAppRequest(app_id="app-a"), metadata=owner.md)
    assert r.deleted_samples == 36 and r.deleted_adapters == 1 and r.deleted_jobs == 1 and r.freed_bytes > 0
    assert not app_dir.exists()
    assert list(a.data.ListDatasets(data_pb2.ListDatasetsRequest(), metadata=a.md).datasets) == []
    assert list(a.jobs.ListSchedules(jobs_pb2.ListSchedulesRequest(), metadata=a.md).schedules) == []
    code, _, _ = code_of(lambda: a.adapters.GetAdapter(adapters_pb2.GetAdapterRequest(adapter_id=aid), metadata=a.md))
    assert code == NF
