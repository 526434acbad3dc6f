"""Daemon features federation needs: ImportAdapter, jobs from a stored adapter with A frozen, composed Generate."""

from __future__ import annotations

import dataclasses
import io
import tarfile
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import lorad.client as lc
from lorad.client.federated.lora import FedLora, b_key, module_shapes, peft_tar, read_peft_tar, seeded_as
from lorad.v1 import adapters_pb2
from tests.integration.helpers import append, code_of, corpus

FAST = lc.RetryPolicy(max_attempts=2, initial_backoff_seconds=0.01, max_backoff_seconds=0.05)


def _model_hash(model_dir: Path, cache: Path) -> str:
    from lorad.server.engine.models.loader import resolve

    return resolve(model_dir, cache).model_hash


def _global_adapter(model_dir: Path, base_hash: str, rng: np.random.Generator) -> tuple[FedLora, dict]:
    import json

    fed = FedLora(base_model_sha256=base_hash, rank=4, alpha=8.0, targets=("q_proj", "v_proj"), seed=5)
    shapes = module_shapes(json.loads((model_dir / "config.json").read_text()), fed.targets)
    t = seeded_as(fed, shapes)
    t |= {b_key(m): rng.normal(scale=0.05, size=(o, fed.rank)).astype(np.float32) for m, (o, _) in shapes.items()}
    return fed, t


def test_import_train_from_it_with_a_frozen_and_compose(make_daemon: Any, tiny_llama: Path, tmp_path: Path) -> None:
    d = make_daemon()
    stubs, token = d.register("fedapp")
    append(stubs, samples=corpus(24))
    base_hash = _model_hash(tiny_llama, tmp_path / "hashcache")
    fed, tensors = _global_adapter(tiny_llama, base_hash, np.random.default_rng(0))
    blob = peft_tar(fed, tensors)
    with lc.Client(f"unix:{d.daemon.socket_path}", token, retry=FAST, timeout=60) as c:
        imported = c.import_adapter(blob, base_hash)
        assert imported.base_model_sha256 == base_hash and imported.lora.rank == 4
        assert sorted(imported.lora.target_modules) == ["q_proj", "v_proj"] and not imported.job_id
        # A different explicit LoRA shape than the init adapter's is refused, naming the field.
        with pytest.raises(lc.InvalidArgument, match="init adapter"):
            c.create_job(["notes"], lc.TrainingConfig(init_adapter_id=imported.adapter_id, lora=lc.LoraConfig(rank=8)))
        cfg = lc.TrainingConfig(init_adapter_id=imported.adapter_id, freeze_lora_a=True, max_steps=4, seq_len=64,
                                learning_rate=5e-3, eval_fraction=0.3, batch_size=2, seed=3)  # fmt: skip
        job = c.create_job(["notes"], cfg)
        assert job.config.init_adapter_id == imported.adapter_id and job.config.freeze_lora_a
        assert job.config.lora.rank == 4  # taken from the adapter
        for _ in c.watch(job):
            pass
        job = c.get_job(job)
        assert job.state == lc.JobState.SUCCEEDED, job
        out = tmp_path / "trained.tar"
        c.download_adapter(job, out)
        _, trained = read_peft_tar(out.read_bytes())
        for k, v in tensors.items():
            if ".lora_A." in k:
                np.testing.assert_array_equal(trained[k], v)  # A frozen exactly
        moved = [k for k in tensors if ".lora_B." in k and not np.allclose(trained[k], tensors[k])]
        assert moved, "B did not train"
        # "before" is the imported adapter's held-out loss, not the bare base model's.
        assert job.progress.eval_loss_before is not None
        # Generate composes adapters: global + trained; greedy output is deterministic and differs from either alone.
        both = c.generate_text("Note 3?", adapter=imported.adapter_id, extra_adapters=[job], max_tokens=8)
        assert both == c.generate_text("Note 3?", adapter=imported.adapter_id, extra_adapters=[job], max_tokens=8)
    # The CLI takes the same composition.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env |= {"HOME": str(tmp_path), "LORAD_CLIENT_CONFIG": str(tmp_path / "client.toml"), "LORAD_TOKEN": token,
            "LORAD_TARGET": f"unix:{d.daemon.socket_path}"}  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "lorad.client.cli", "generate", "Note 3?", "--adapter",
                        imported.adapter_id, "--with-adapter", job.adapter_id, "--max-tokens", "8", "--json"],
                       check=False, capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert __import__("json").loads(r.stdout)["text"] == both


def test_import_refuses_another_base_bad_digest_and_foreign_members(make_daemon: Any, tiny_llama: Path,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    d = make_daemon()
    stubs, token = d.register("fedapp")
    base_hash = _model_hash(tiny_llama, tmp_path / "hashcache")
    fed, tensors = _global_adapter(tiny_llama, base_hash, np.random.default_rng(1))
    blob = peft_tar(fed, tensors)
    with lc.Client(f"unix:{d.daemon.socket_path}", token, retry=FAST, timeout=60) as c:
        with pytest.raises(lc.FailedPrecondition, match="base model"):
            c.import_adapter(blob, "0" * 64)
        assert c.list_adapters() == []

    def raw(msgs: list[adapters_pb2.ImportAdapterRequest]) -> Any:
        return stubs.adapters.ImportAdapter(iter(msgs), metadata=stubs.md)

    import hashlib

    def header(data: bytes, **kw: Any) -> adapters_pb2.ImportAdapterRequest:
        h = {"base_model_sha256": base_hash, "total_size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        return adapters_pb2.ImportAdapterRequest(header=adapters_pb2.ImportAdapterHeader(**(h | kw)))

    code, msg, _ = code_of(lambda: raw([header(blob, sha256="1" * 64), adapters_pb2.ImportAdapterRequest(chunk=blob)]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "hash" in msg
    code, msg, _ = code_of(lambda: raw([adapters_pb2.ImportAdapterRequest(chunk=blob)]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "header" in msg
    code, msg, _ = code_of(lambda: raw([header(blob), adapters_pb2.ImportAdapterRequest(chunk=blob[:100])]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bytes received" in msg
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        info = tarfile.TarInfo("../escape.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    bad = evil.getvalue()
    code, msg, _ = code_of(lambda: raw([header(bad), adapters_pb2.ImportAdapterRequest(chunk=bad)]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "may hold only" in msg
    assert not list(d.data_dir.rglob("escape.json"))
    assert stubs.adapters.ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=stubs.md).adapters == []
    assert not [p for p in (d.data_dir / "apps" / "fedapp").rglob("*") if p.is_file() and ".tmp-" in p.name]


def test_compose_adds_the_updates() -> None:
    import torch

    from lorad.server.engine.models.model import AdapterWeights
    from lorad.server.inference import compose

    g = torch.Generator().manual_seed(0)

    def rand(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(r, 6, generator=g), torch.randn(5, r, generator=g)

    w1 = AdapterWeights({"m.q": rand(2), "m.v": rand(2)}, 0.5)
    w2 = AdapterWeights({"m.q": rand(3)}, 2.0)
    c = compose([w1, w2])
    a, b = c.tensors["m.q"]
    want = 0.5 * w1.tensors["m.q"][1] @ w1.tensors["m.q"][0] + 2.0 * w2.tensors["m.q"][1] @ w2.tensors["m.q"][0]
    torch.testing.assert_close(c.scale * b @ a, want)
    a, b = c.tensors["m.v"]
    torch.testing.assert_close(c.scale * b @ a, 0.5 * w1.tensors["m.v"][1] @ w1.tensors["m.v"][0])


def test_a_round_reaps_what_a_killed_round_left(make_daemon: Any, tiny_llama: Path, tmp_path: Path) -> None:
    """A SuperNode killed mid-round leaves its job and adapters; the next round cancels the one and deletes the
    others, and leaves the app's own jobs and adapters alone."""
    from lorad.client.federated.device import reap_orphans
    from tests.integration.helpers import GOOD_PROBE

    d = make_daemon()
    stubs, token = d.register("fedapp")
    append(stubs, samples=corpus(24))
    base_hash = _model_hash(tiny_llama, tmp_path / "hashcache")
    fed, tensors = _global_adapter(tiny_llama, base_hash, np.random.default_rng(0))
    cfg = lc.TrainingConfig(max_steps=2, seq_len=64, eval_fraction=0.3, batch_size=2)
    with lc.Client(f"unix:{d.daemon.socket_path}", token, retry=FAST, timeout=60) as c:

        def done(job: lc.Job) -> lc.Job:
            for _ in c.watch(job):
                pass
            return c.get_job(job)

        own = done(c.create_job(["notes"], cfg, request_id="fed-notes"))  # the app's own, not a round's
        # The app's own jobs that merely look like rounds: from scratch, and on from its own adapter.
        lookalike = done(c.create_job(["notes"], cfg, request_id="fed-1-1"))
        on_own = done(c.create_job(["notes"], dataclasses.replace(cfg, init_adapter_id=own.adapter_id),
                                   request_id="fed-1-2"))  # fmt: skip

        def round_cfg() -> lc.TrainingConfig:  # a round starts from the global adapter it imported
            imported = c.import_adapter(peft_tar(fed, tensors), base_hash)
            return dataclasses.replace(cfg, init_adapter_id=imported.adapter_id)

        finished = done(c.create_job(["notes"], round_cfg(), request_id="fed-7-1"))  # killed before it cleaned up
        assert finished.state == lc.JobState.SUCCEEDED and finished.adapter_id
        d.set_probe({**GOOD_PROBE, "charging": False})  # the next orphan waits for the charger
        stuck = c.create_job(["notes"], round_cfg(), request_id="fed-7-2")
        current = c.create_job(["notes"], round_cfg(), request_id="fed-8-1")  # the round now running is kept
        kept = {own.adapter_id, lookalike.adapter_id, on_own.adapter_id, current.config.init_adapter_id}

        assert reap_orphans(c, "fed-8-1") == 1
        assert c.get_job(stuck).state == lc.JobState.CANCELLED
        assert not c.get_job(current).is_final
        assert {a.adapter_id for a in c.list_adapters()} == kept
        assert reap_orphans(c, "fed-8-1") == 0  # nothing left to reap
        c.cancel_job(current)
