"""The SDK and the CLI against the daemon's one TrainConfig declaration (the SDK does not import the daemon)."""

from __future__ import annotations

import argparse
import dataclasses
import re

from lorad.client import types as t
from lorad.client.cli import _jobs
from lorad.server.engine.training.config import TrainConfig, api_key, api_knobs

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
BY_API = {api_key(k): name for name, k in api_knobs().items()}
# CLI option dest -> TrainConfig field
CLI = {"rank": "rank", "alpha": "alpha", "dropout": "dropout", "steps": "steps", "lr": "lr",
       "batch_size": "batch_size", "seq_len": "seq_len", "grad_accum": "grad_accum", "warmup": "warmup_steps",
       "weight_decay": "weight_decay", "eval_every": "eval_every", "eval_fraction": "eval_fraction"}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    _jobs.add_parsers(p.add_subparsers(), argparse.ArgumentParser(add_help=False))
    return p


def test_cli_limits_are_the_training_config_bounds() -> None:
    for dest, name in CLI.items():
        flag, lo, hi, lo_open, hi_open = _jobs.LIMITS[dest]
        k = api_knobs()[name]
        assert (lo, hi, hi_open) == (k.lo, k.hi, k.hi_open), (flag, k)
        # The CLI may refuse a 0 the API would read as "unset" (the job default); nothing else may differ.
        assert lo_open == k.lo_open or (lo == 0 and lo_open), (flag, k)


def test_cli_help_states_the_job_defaults() -> None:
    train = _parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    helps = {a.dest: a.help or "" for a in train._actions}
    for dest, name in CLI.items():
        k, default = api_knobs()[name], FIELDS[name].default
        m = re.search(r"\(default ([^)]+)\)", helps[dest])
        if m:
            doc, said = k.api_default_doc(default).replace("2 * rank", "2r"), m.group(1)
            same = said == doc or (re.fullmatch(r"[0-9.e-]+", said) is not None and float(said) == float(doc))
            assert same, (dest, said, doc)
    for dest in ("rank", "steps", "lr", "seq_len", "eval_every", "eval_fraction"):
        assert "(default" in helps[dest], dest
    assert ",".join(_jobs.TARGETS) in helps["targets"] and api_knobs()["targets"].choices == _jobs.TARGETS


def test_sdk_fields_are_the_api_fields_and_default_to_unset() -> None:
    cfg, lora = t.TrainingConfig(), t.LoraConfig()
    names = {f.name for f in dataclasses.fields(cfg) if f.name != "lora"} | {f.name for f in dataclasses.fields(lora)}
    assert names == set(BY_API) | {"base_model", "init_adapter_id"}
    for obj in (cfg, lora):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name != "lora":
                assert not v or getattr(v, "value", "") in ("auto", "default"), (f.name, v)
