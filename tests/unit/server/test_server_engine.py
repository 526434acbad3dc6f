"""The real engine session: the loss before training is measured once and exact; phases and notices arrive in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorad.server.backend import decide_backend
from lorad.server.engine.training.config import job_config
from lorad.server.jobs.engine import EngineSession
from lorad.server.jobs.session import SessionRequest
from lorad.server.modelhost import ModelHost
from lorad.server.records import (
    DataSummary,
    JobSpec,
    Message,
    Phase,
    Progress,
    Requirements,
    SampleBody,
)
from tests.fixtures.tiny_hf import save_tiny_hf


class RecordingSink:
    """Records what a session reports."""

    def __init__(self) -> None:
        self.before: list[tuple[float, int]] = []
        self.progress_steps: list[int] = []
        self.train_losses: list[float] = []
        self.notices: list[str] = []
        self.backends: list[tuple[str, str]] = []
        self.log: list[tuple[str, Any]] = []  # every report in order: ("phase", (phase, fraction)), ("step", 3), …
        self.data_summaries: list[DataSummary] = []

    def backend(self, name: str, reason: str) -> None:
        self.backends.append((name, reason))

    def eval_before(self, loss: float, total_steps: int) -> None:
        self.before.append((loss, total_steps))

    def progress(self, progress: Progress, *, evaluated: bool) -> None:
        self.progress_steps.append(progress.step)
        self.train_losses.append(progress.train_loss)
        self.log.append(("step", progress.step))

    def checkpoint(self, step: int, path: Path, size_bytes: int, train_loss: float) -> None:
        pass

    def notice(self, message: str) -> None:
        self.notices.append(message)
        self.log.append(("notice", message))

    def warning(self, message: str) -> None:
        self.log.append(("warning", message))

    def phase(self, phase: Phase, fraction: float | None) -> None:
        self.log.append(("phase", (phase, fraction)))

    def data(self, summary: DataSummary) -> None:
        self.data_summaries.append(summary)
        self.log.append(("data", summary))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp("m"), "llama")


def _samples(n: int = 16) -> tuple[SampleBody, ...]:
    return tuple(
        SampleBody(messages=(Message("user", f"What is note {i}?"), Message("assistant", f"Note {i} is a fox.")))
        for i in range(n)
    )


def _session(tiny: Path, work: Path, before: float | None, steps: int = 3, samples: tuple[SampleBody, ...] = (),
             **kw: Any) -> EngineSession:  # fmt: skip
    p = dict(rank=4, steps=steps, batch_size=2, seq_len=64, eval_fraction=0.3, eval_every=100, checkpoint_every=100,
             dropout=0.1, lr=1e-3, seed=3, backend="torch", precision="fp32")  # fmt: skip
    p.update(kw)
    spec = JobSpec(("ds",), job_config(p), Requirements(False, 0, 80.0, False))
    req = SessionRequest("job_x", "app", spec, samples or _samples(), work, 2, before)
    decision = decide_backend("torch")
    models = ModelHost(str(tiny), (), work.parent / "cache", decision)
    return EngineSession(req, models, work.parent / "cache", decision)


def _run(tiny: Path, work: Path, before: float | None, steps: int = 3, **kw: Any) -> tuple[RecordingSink, Any]:
    sink = RecordingSink()
    out = _session(tiny, work, before, steps, **kw).run(lambda: False, sink)
    assert out.completed and out.adapter is not None
    return sink, out.adapter


def _base_eval_loss(tiny: Path, cache: Path) -> float:
    """Independent reference: the base model without any LoRA over the trainer's held-out batches."""
    from lorad.server.engine.api import prepare
    from lorad.server.engine.models.loader import load_model
    from lorad.server.engine.training.packing import eval_batches, target_count
    from lorad.server.jobs.engine import _training_samples

    loaded = load_model(tiny, cache_root=cache, backend="torch", precision="fp32", lora=None)
    tok = loaded.tokenizer
    data = prepare(_training_samples(_samples()), tok, seq_len=64, eval_fraction=0.3)
    batches = eval_batches(data.eval, seq_len=64, batch_size=2, pad_id=tok.eos_id or 0, max_batches=10_000)
    num = den = 0.0
    with torch.no_grad():
        for x, y in batches:
            n = target_count(y)
            num += float(loaded.model(x, y)) * n
            den += n
    return num / den


def test_loss_before_is_the_base_models_and_reaches_the_adapter(tiny: Path, tmp_path: Path) -> None:
    sink, art = _run(tiny, tmp_path / "a", None)
    assert len(sink.before) == 1, "measured exactly once"
    loss, total = sink.before[0]
    assert total == 3
    # The trainer caps held-out batches (cfg.eval_batches); the tiny set is far below that cap.
    assert loss == pytest.approx(_base_eval_loss(tiny, tmp_path / "cache"), rel=1e-5)
    assert art.eval_loss_before == loss
    assert art.eval_loss_after < loss, "a few steps on the data lower the held-out loss"


def test_a_stored_loss_before_is_not_measured_again_and_measuring_leaves_training_unchanged(
    tiny: Path, tmp_path: Path
) -> None:
    measured, _ = _run(tiny, tmp_path / "a", None)
    stored, art = _run(tiny, tmp_path / "b", 1.25)
    assert stored.before == []
    assert art.eval_loss_before == 1.25
    # Dropout draws from torch's global RNG: measuring must not shift the training trajectory.
    assert measured.train_losses == stored.train_losses


def test_every_step_reports_progress_and_phases_and_the_data_notice_come_when_they_happen(
    tiny: Path, tmp_path: Path
) -> None:
    too_long = SampleBody(messages=(Message("user", "word " * 200), Message("assistant", "ok")))
    sink, _ = _run(tiny, tmp_path / "a", None, steps=5, eval_every=2, samples=(*_samples(), too_long))
    assert sink.progress_steps == [1, 2, 3, 4, 5], "steps that end with an evaluation report progress too"
    kinds = [k for k, _ in sink.log]
    phases = [v[0] for k, v in sink.log if k == "phase"]
    assert phases[0] is Phase.LOADING
    # data is prepared while loading: its report comes before the base model's evaluation and the first step
    assert kinds.index("data") < kinds.index("step")
    assert phases[phases.index(Phase.LOADING) + 1] is Phase.EVALUATING  # the loss before training
    first_train = sink.log.index(("phase", (Phase.TRAINING, 0.0)))
    assert first_train < kinds.index("step")
    # each evaluation (after steps 2, 4 and the last) is announced before that step's progress
    for step in (2, 4, 5):
        at = sink.log.index(("step", step))
        assert sink.log[at - 1] == ("phase", (Phase.EVALUATING, None)), sink.log[at - 3 : at + 1]
    assert sink.log[-1] == ("phase", (Phase.EXPORTING, None))
    (summary,) = sink.data_summaries
    assert summary.total_samples == 17 and summary.rejected == (("too_long", 1),)
    assert summary.train_samples + summary.eval_samples == 16 and summary.eval_samples >= 1
    assert not any(n.startswith("data:") for n in sink.notices), "the runner words the data notice, not the engine"


def test_resume_notice_arrives_before_the_first_resumed_step(tiny: Path, tmp_path: Path) -> None:
    work = tmp_path / "a"
    first = RecordingSink()
    out = _session(tiny, work, None, steps=4).run(lambda: len(first.progress_steps) >= 2, first)
    assert not out.completed and first.progress_steps == [1, 2]
    assert not any("resumed" in n for n in first.notices)
    again = RecordingSink()
    out = _session(tiny, work, 1.5, steps=4).run(lambda: False, again)
    assert out.completed and again.progress_steps == [3, 4]
    notice = again.log.index(("notice", "resumed from checkpoint step 2"))
    assert notice < again.log.index(("step", 3))
    assert ("phase", (Phase.TRAINING, 0.5)) in again.log


def test_a_single_usable_sample_warns_that_no_held_out_loss_will_come(tiny: Path, tmp_path: Path) -> None:
    sink, _ = _run(tiny, tmp_path / "a", None, steps=2, samples=_samples(1))
    warnings = [v for k, v in sink.log if k == "warning"]
    assert len(warnings) == 1 and "no held-out samples" in warnings[0]
    assert sink.before == [] and sink.data_summaries[0].eval_samples == 0


def test_exported_peft_config_names_a_portable_base_and_metadata_keeps_the_content_hash(
    tiny: Path, tmp_path: Path
) -> None:
    import json

    from lorad.server.engine.models.sources import DEFAULT_HF_ID, portable_base_name

    _, art = _run(tiny, tmp_path / "a", None, steps=1)
    cfg = json.loads((art.path / "adapter_config.json").read_text())
    meta = json.loads((art.path / "lorad_metadata.json").read_text())
    # A folder model records its name, never this device's absolute path; the hash pins the exact weights.
    assert cfg["base_model_name_or_path"] == tiny.name and not cfg["base_model_name_or_path"].startswith("/")
    assert meta["base_model_source"] == tiny.name
    assert len(meta["base_model_hash"]) == 64 and meta["base_model_hash"] == art.base_model_sha256

    assert portable_base_name(None) == DEFAULT_HF_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    saved_from_hub = tmp_path / "my-copy"
    saved_from_hub.mkdir()
    (saved_from_hub / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}))
    assert portable_base_name(saved_from_hub) == "Qwen/Qwen2.5-0.5B-Instruct"
    (saved_from_hub / "config.json").write_text(json.dumps({"_name_or_path": "/home/u/models/x"}))
    assert portable_base_name(saved_from_hub) == "my-copy"
    assert portable_base_name(Path("/data/models/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_model_facts_never_wait_for_the_first_read_and_name_an_unreadable_model(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GetDeviceStatus reads these: a first read (a GGUF converted into the cache) must not hold the RPC past a
    client's deadline, as it did on a slow host."""
    import threading
    import time

    import lorad.server.engine.api as api
    from lorad.server import modelhost
    from lorad.server.modelhost import READING, UNREADABLE, ModelFacts

    # Every read starts with the cache lookup (a missing source fails right there, before any conversion), so the gate
    # holds each read, the retry of the missing one included.
    gate, real = threading.Event(), api.cached_checkpoint

    def slow(*a: Any, **k: Any) -> Any:
        gate.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(api, "cached_checkpoint", slow)
    host = ModelHost(str(tiny), (str(tmp_path / "gone"),), tmp_path / "cache", decide_backend("torch"))
    t0 = time.monotonic()
    assert host.facts("") == READING and host.facts("") == READING and time.monotonic() - t0 < 1.0
    gate.set()

    def settled(name: str) -> Any:
        for _ in range(300):
            got = host.facts(name)
            if got != READING:
                return got
            time.sleep(0.05)
        raise AssertionError(f"facts of {name!r} still reading")

    facts = settled("")
    assert isinstance(facts, ModelFacts) and facts.family == "llama" and facts.parameters > 0
    gone = settled("gone")
    assert isinstance(gone, str) and gone.startswith(UNREADABLE), gone
    assert host.facts("") is facts  # later calls are a lookup
    assert host.facts("gone") == gone  # a failed read is not retried on every status poll...
    monkeypatch.setattr(modelhost, "FACTS_RETRY_S", 0.0)
    gate.clear()  # the retry's read waits, so it is seen in progress
    assert host.facts("gone") == gone and host.facts("gone") == READING  # ...only once FACTS_RETRY_S has passed
    gate.set()
    assert settled("gone") == gone


def test_the_base_model_generates_at_the_generation_precision(tiny: Path, tmp_path: Path) -> None:
    """Generate's model: bf16 where the CPU has bf16 dot products (half the weights held and read per token), else the
    fp32 reference; the same choice as an unplanned job's."""
    from lorad.kernels.capabilities import capability, native_on_this_cpu

    host = ModelHost(str(tiny), (), tmp_path / "cache", decide_backend("torch"))
    want = "bf16" if native_on_this_cpu("bf16").native else "fp32"
    assert capability("torch").generation() == capability("torch").unplanned() == want
    layer = host.base("").model.layers[0].self_attn.q_proj.frozen
    assert (layer.precision_fwd, layer.precision_bwd) == (want, want)
