"""Credentials, socket permissions, health and reflection."""

from __future__ import annotations

import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorad.v1 import apps_pb2, data_pb2, device_pb2
from tests.integration.helpers import code_of

pytestmark = pytest.mark.integration
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def test_tokens_permissions_and_modes(make_daemon) -> None:
    d = make_daemon()
    tok = d.data_dir / "owner.token"
    assert stat.S_IMODE(tok.stat().st_mode) == 0o600
    assert stat.S_IMODE(d.daemon.socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(d.daemon.socket_path.parent.stat().st_mode) == 0o700
    ch = d.channel()
    no_token = data_pb2.ListDatasetsRequest()
    from lorad.v1 import data_pb2_grpc

    stub = data_pb2_grpc.DataServiceStub(ch)
    assert code_of(lambda: stub.ListDatasets(no_token))[0] == UNAUTH
    assert code_of(lambda: stub.ListDatasets(no_token, metadata=(("authorization", "Bearer nope"),)))[0] == UNAUTH
    assert code_of(lambda: stub.ListDatasets(no_token, metadata=(("authorization", "Basic x"),)))[0] == UNAUTH

    app, token = d.register("notes", max_samples=10)
    assert len(token) == 43
    # The token is stored only as a hash.
    assert token.encode() not in (d.data_dir / "lorad.sqlite").read_bytes()
    # Apps cannot call owner-only methods; the owner cannot call app-scoped ones.
    assert code_of(lambda: app.apps.ListApps(apps_pb2.ListAppsRequest(), metadata=app.md))[0] == (
        grpc.StatusCode.PERMISSION_DENIED)  # fmt: skip
    owner = d.owner()
    assert code_of(lambda: owner.data.ListDatasets(no_token, metadata=owner.md))[0] == grpc.StatusCode.PERMISSION_DENIED
    apps = owner.apps.ListApps(apps_pb2.ListAppsRequest(), metadata=owner.md).apps
    assert [a.app_id for a in apps] == ["notes"] and apps[0].quota.max_samples == 10
    code, msg, _ = code_of(lambda: d.register("notes"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "notes" in msg
    code, _, trailing = code_of(lambda: d.register("Bad/Id"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and trailing["lorad-error-field"] == "app_id"
    # Any app may read the device status; it names the backend and why.
    st = app.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=app.md)
    assert st.backend.reason and st.readings.source == "file" and st.can_train
    assert st.readings.battery_percent == 90 and st.readings.charging and st.models[0].is_default


def test_health_and_reflection_without_token(make_daemon) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    d = make_daemon()
    ch = d.channel()
    h = health_pb2_grpc.HealthStub(ch)
    assert h.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    svc = h.Check(health_pb2.HealthCheckRequest(service="lorad.v1.JobService"))
    assert svc.status == health_pb2.HealthCheckResponse.SERVING
    r = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"lorad.v1.JobService", "lorad.v1.DataService", "grpc.health.v1.Health"} <= names


def test_tcp_address_file_names_the_bound_port_while_serving(make_daemon) -> None:
    d = make_daemon(tcp=True)
    f = d.daemon.tcp_address_file
    assert f.read_text() == f"127.0.0.1:{d.daemon.tcp_port}\n" and d.daemon.tcp_port > 0
    assert f.parent == d.daemon.socket_path.parent, "owner-only run directory, next to the socket"
    d.stop()
    assert not f.exists()
