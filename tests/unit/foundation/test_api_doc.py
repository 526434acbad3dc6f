"""docs/api.md states what the code does: header, error trailer, open services, port file, package options, RPCs."""

from __future__ import annotations

import re
from pathlib import Path

from lorad.server.daemon import TCP_ADDRESS_FILE
from lorad.server.rpc.errors import FIELD_METADATA_KEY
from lorad.server.rpc.interceptor import PUBLIC_PREFIXES
from lorad.v1 import adapters_pb2, apps_pb2, common_pb2, data_pb2, device_pb2, inference_pb2, jobs_pb2

DOC = (Path(__file__).resolve().parents[3] / "docs" / "api.md").read_text()


def test_doc_names_the_header_trailer_open_services_and_port_file_the_daemon_uses() -> None:
    assert "`authorization: Bearer <token>`" in DOC
    assert f"`{FIELD_METADATA_KEY}`" in DOC and f'"{FIELD_METADATA_KEY}"' in DOC  # prose and the Kotlin snippet
    for prefix in PUBLIC_PREFIXES:
        assert prefix.strip("/").rstrip(".") in DOC, prefix
    assert f"<data_dir>/run/{TCP_ADDRESS_FILE}" in DOC
    opts = jobs_pb2.DESCRIPTOR.GetOptions()
    assert f'java_package = "{opts.java_package}"' in DOC and f'go_package = "{opts.go_package}"' in DOC


def test_doc_covers_every_service_and_the_kotlin_example_uses_real_names() -> None:
    modules = (adapters_pb2, apps_pb2, common_pb2, data_pb2, device_pb2, inference_pb2, jobs_pb2)
    for m in modules:
        for name in m.DESCRIPTOR.services_by_name:
            assert name in DOC, name
    # Every message the Kotlin example builds exists in the protos (a renamed type breaks the doc here).
    code = DOC[DOC.index("```kotlin\n   import dev.lorad.v1") :]
    known = {n for m in modules for n in m.DESCRIPTOR.message_types_by_name}
    used = set(re.findall(r"\b([A-Z][A-Za-z]+)\.newBuilder\(\)", code))
    assert used and used <= known, used - known
    for value in ("JOB_STATE_SUCCEEDED", "ROLE_USER", "ROLE_ASSISTANT"):
        assert value in code
