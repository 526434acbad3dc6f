"""`lorad data add` input formats: .json arrays and objects, a UTF-8 BOM, and errors that name file:line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from lorad.client.samples import SampleFormatError, read_samples, read_stream
from lorad.client.types import ChatSample, TextSample

CHAT = {"messages": [{"role": "user", "content": "Who is Tofu?"}, {"role": "assistant", "content": "A whippet."}]}


def test_json_array_is_one_sample_per_element(tmp_path: Path) -> None:
    p = tmp_path / "notes.json"
    p.write_text(json.dumps([{"text": "a"}, CHAT, "plain string"], indent=2))
    got = read_samples(p)
    assert got[0] == TextSample("a") and isinstance(got[1], ChatSample) and got[2] == TextSample("plain string")
    assert len(got) == 3


def test_json_object_is_one_sample_and_empty_array_none(tmp_path: Path) -> None:
    p = tmp_path / "one.json"
    p.write_text(json.dumps(CHAT, indent=2))
    assert len(read_samples(p)) == 1 and isinstance(read_samples(p)[0], ChatSample)
    p.write_text("[ ]\n")
    assert read_samples(p) == []


def test_json_errors_name_the_line_of_the_bad_element(tmp_path: Path) -> None:
    p = tmp_path / "bad.json"
    p.write_text('[\n  {"text": "ok"},\n  {"messages": [{"role": "nobody", "content": "x"}]}\n]\n')
    with pytest.raises(SampleFormatError, match=rf"^{p}:3: .*role"):
        read_samples(p)
    p.write_text('[\n  {"text": "ok"},\n  {"text": "unterminated\n]\n')
    with pytest.raises(SampleFormatError, match=rf"^{p}:3: not valid JSON"):
        read_samples(p)
    p.write_text("42\n")
    with pytest.raises(SampleFormatError, match=rf"^{p}:1: expected an array of samples or one object"):
        read_samples(p)


def test_utf8_bom_is_ignored_in_jsonl_json_text_and_stdin(tmp_path: Path) -> None:
    bom = "\ufeff"
    (tmp_path / "a.jsonl").write_text(bom + json.dumps({"text": "first"}) + "\n" + json.dumps(CHAT) + "\n")
    assert read_samples(tmp_path / "a.jsonl")[0] == TextSample("first")
    (tmp_path / "a.json").write_text(bom + json.dumps([{"text": "x"}]))
    assert read_samples(tmp_path / "a.json") == [TextSample("x")]
    (tmp_path / "a.txt").write_text(bom + "hello")
    assert read_samples(tmp_path / "a.txt") == [TextSample("hello")]
    assert read_stream(io.StringIO(bom + json.dumps({"text": "s"}) + "\n")) == [TextSample("s")]


def test_stdin_detects_a_json_array_and_a_pretty_printed_object() -> None:
    assert len(read_stream(io.StringIO(json.dumps([CHAT, {"text": "b"}], indent=2)))) == 2
    assert isinstance(read_stream(io.StringIO(json.dumps(CHAT, indent=2)))[0], ChatSample)
    assert read_stream(io.StringIO("{not json at all\n but text")) == [TextSample("{not json at all\n but text")]
