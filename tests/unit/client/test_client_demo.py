"""The demo's pieces: the bundled persona data, fact scoring, the nightly-style window, config and report."""

from __future__ import annotations

import datetime as dt
import io
import json
from pathlib import Path

import pytest

from lorad.client import types as t
from lorad.client.demo import daemon as demo_daemon
from lorad.client.demo import persona
from lorad.client.demo.runner import Answer, DemoResult, DemoSettings, next_window, training_config


def test_persona_dataset_is_sized_and_mixed() -> None:
    samples = persona.load_samples()
    assert 60 <= len(samples) <= 150
    chats = [s for s in samples if isinstance(s, t.ChatSample)]
    texts = [s for s in samples if isinstance(s, t.TextSample)]
    assert len(chats) >= 30 and len(texts) >= 30
    assert all(any(m.role is t.Role.ASSISTANT for m in c.messages) for c in chats)
    assert len({json.dumps(str(s)) for s in samples}) == len(samples)  # no duplicates (the daemon would drop them)


def test_every_question_fact_is_taught_but_no_question_is_verbatim() -> None:
    samples = persona.load_samples()
    corpus = " ".join(
        s.text if isinstance(s, t.TextSample) else " ".join(m.content for m in s.messages) for s in samples
    )
    user_turns = {m.content for s in samples if isinstance(s, t.ChatSample) for m in s.messages}
    questions = persona.load_questions()
    assert len(questions) >= 4
    for q in questions:
        assert q.question not in user_turns, q.question
        assert persona.states_fact(corpus, q), q.facts


def test_a_keyword_with_a_wrong_claim_gets_no_check_mark() -> None:
    by_q = {q.question: q for q in persona.load_questions()}
    sister = by_q["Where does my sister Elin live?"]
    assert not persona.mentions_fact("Elin lives in Umeå, in the south of Sweden.", sister)
    assert persona.mentions_fact("Elin lives in Umeå, up north.", sister)
    dog = by_q["What is my dog called?"]
    assert not persona.mentions_fact("Tofu is a type of vegan vegan vegan food.", dog)
    assert persona.mentions_fact("Your dog is Tofu, a grey whippet.", dog)
    running = by_q["On which days do I go running?"]
    assert not persona.mentions_fact("You run on Tuesdays.", running)  # half the answer
    assert not persona.mentions_fact("Tuesday, Thursday and Saturday.", running)
    assert persona.mentions_fact("Tuesdays and Thursdays at six, and a long run on Sunday.", running)


def test_mentions_fact_ignores_case_and_accents() -> None:
    q = persona.Question("where?", ("Umeå",))
    assert persona.mentions_fact("She lives in UMEA.", q)
    assert not persona.mentions_fact("She lives in Uppsala.", q)


def test_next_window_is_a_daily_cron_at_least_lead_seconds_ahead() -> None:
    now = dt.datetime(2026, 12, 2, 23, 59, 45, tzinfo=dt.UTC)
    w = next_window(now, 20)
    assert (w.cron, w.timezone) == ("1 0 * * *", "UTC")  # 00:00 is only 15 s away: the next minute it is
    w = next_window(dt.datetime(2026, 12, 2, 10, 0, 5, tzinfo=dt.UTC), 20)
    assert w.cron == "1 10 * * *"


def test_training_config_is_small_and_explicit() -> None:
    c = training_config(DemoSettings(steps=30, seq_len=128, rank=8))
    assert (c.max_steps, c.seq_len, c.lora.rank, c.lora.alpha) == (30, 128, 8, 16.0)
    assert 0 < c.warmup_steps < c.max_steps and c.eval_every_steps == 10


def test_daemon_config_is_valid_for_the_real_daemon(tmp_path: Path) -> None:
    server_config = pytest.importorskip("lorad.server.config")
    text = demo_daemon.daemon_config(tmp_path / "data", tmp_path / "probe.json", 2)
    import tomllib

    cfg = server_config.build_config(tomllib.loads(text), env={})
    assert cfg.data_dir == tmp_path / "data" and cfg.conditions.probe == "file"
    assert cfg.conditions.probe_file == str(tmp_path / "probe.json") and cfg.conditions.require_charging
    assert cfg.socket_path == demo_daemon.DemoDaemon(root=tmp_path).socket_path == tmp_path / "data/run/lorad.sock"


def test_probe_file_is_what_the_daemon_file_probe_reads(tmp_path: Path) -> None:
    probes = pytest.importorskip("lorad.server.device.probes")
    f = tmp_path / "device.json"
    demo_daemon.write_probe(f, demo_daemon.UNPLUGGED)
    r = probes.FileProbe(f).read()
    assert (r.charging, r.battery_percent) == (False, 38)
    demo_daemon.write_probe(f, demo_daemon.PLUGGED_IN)
    r = probes.FileProbe(f).read()
    assert (r.charging, r.temperature_celsius, r.idle) == (True, 31.5, True)


def test_report_counts_recalled_facts() -> None:
    from lorad.client.demo.runner import Demo

    qs = persona.load_questions()[:2]
    answers = (Answer(qs[0], "I do not know.", "Your dog is Tofu."), Answer(qs[1], "Echos", "Kardemumma & Co."))
    job = t.Job("j", "", (), t.TrainingConfig(), t.DeviceRequirements(), None, t.JobState.SUCCEEDED,
                t.BlockedReason.NONE, "", t.JobProgress(), None, "a", "", "", 0, 0, 0, 0)  # fmt: skip
    r = DemoResult(job, answers, 3.2, 1.1, "/x/a.tar", "ab" * 32, 12.0)
    assert r.hits == (0, 2)
    out = io.StringIO()
    Demo(DemoSettings(), out).report(r)
    text = out.getvalue()
    assert "facts recalled: base 0/2, adapter 2/2" in text and "before 3.200 → after 1.100" in text
    assert "✓ adapter: Your dog is Tofu." in text and "· base   : I do not know." in text
    # Without --keep the adapter file is gone with the temp dir: its path is not printed.
    assert "/x/a.tar" not in text and "removed with the demo's temporary directory (run with --keep" in text
    kept = io.StringIO()
    Demo(DemoSettings(keep=True), kept).report(r)
    assert f"adapter: /x/a.tar (sha256 {'ab' * 32})" in kept.getvalue()


def test_report_says_when_the_daemon_did_not_measure_a_loss() -> None:
    from lorad.client.demo.runner import Demo, _loss

    assert _loss(float("nan")) is None and _loss(2.5) == 2.5
    q = persona.load_questions()[0]
    job = t.Job("j", "", (), t.TrainingConfig(), t.DeviceRequirements(), None, t.JobState.SUCCEEDED,
                t.BlockedReason.NONE, "", t.JobProgress(), None, "a", "", "", 0, 0, 0, 0)  # fmt: skip
    r = DemoResult(job, (Answer(q, "", "Tofu"),), None, 2.25, "/a", "0" * 64, 1.0, ((13, 2.9), (26, 2.4)))
    out = io.StringIO()
    Demo(DemoSettings(), out).report(r)
    assert "before not reported by the daemon → after 2.250" in out.getvalue()
    assert "step 13 2.900 → step 26 2.400" in out.getvalue()
    assert "(empty)" in out.getvalue()
