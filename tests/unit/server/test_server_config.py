"""Config: defaults, TOML + env overrides, every problem reported at once, data-dir defaults, the example file."""

from pathlib import Path

import pytest

from lorad.server.config import Config, ConfigError, build_config, default_data_dir, load_config

EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "lorad.example.toml"


def test_defaults_are_valid() -> None:
    cfg = build_config({}, env={})
    assert cfg == Config()
    assert cfg.conditions.require_charging is True


def test_example_file_lists_every_key_and_loads_to_defaults() -> None:
    import dataclasses
    import tomllib

    text = EXAMPLE.read_text()
    values = tomllib.loads(text)
    for sec in dataclasses.fields(Config):
        keys = {f.name for f in dataclasses.fields(type(getattr(Config(), sec.name)))}
        if sec.name == "device":
            # deploy/android/install.sh appends this table to a copy of the file, so it is documented in comments.
            assert "[device]" not in text and "device" not in values
            assert all(f"#   {k} = " in text for k in keys), keys
            continue
        assert set(values[sec.name]) == keys, sec.name
    assert load_config(EXAMPLE, env={}) == Config()
    # ... and the installer's copy (the example plus its appended table) loads too.
    device = '[device]\nwake_lock_acquire = "/opt/lorad/bin/lorad-wakelock acquire"\n'
    installed = build_config(tomllib.loads(text + "\n" + device), env={})
    assert installed.device.wake_lock_acquire == "/opt/lorad/bin/lorad-wakelock acquire"


def test_env_overrides_file(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[conditions]\nmax_temperature_celsius = 35.0\nprobe = "sysfs"\n[training]\nmodel_dirs = ["/a"]\n')
    env = {
        "LORAD_CONDITIONS_MAX_TEMPERATURE_CELSIUS": "38",
        "LORAD_CONDITIONS_REQUIRE_CHARGING": "false",
        "LORAD_TRAINING_MODEL_DIRS": "/x, /y",
    }
    cfg = load_config(p, env=env)
    assert cfg.conditions.max_temperature_celsius == 38.0
    assert cfg.conditions.require_charging is False
    assert cfg.conditions.probe == "sysfs"
    assert cfg.training.model_dirs == ("/x", "/y")


def test_every_problem_is_reported_at_once() -> None:
    values = {
        "conditions": {"probe": "magic", "min_battery_percent": 150, "bogus": 1},
        "logging": {"level": "loud"},
        "server": {"tcp_address": "0.0.0.0:80", "max_message_bytes": "big"},
        "nope": {},
    }
    with pytest.raises(ConfigError) as ei:
        build_config(values, env={"LORAD_QUOTAS_MAX_SAMPLES": "many"})
    errs = "\n".join(ei.value.errors)
    for needle in (
        "conditions.probe='magic'",
        "auto, termux, sysfs, file",
        "min_battery_percent=150",
        "conditions.bogus: unknown key",
        "logging.level='loud'",
        "server.tcp_address='0.0.0.0:80'",
        "server.max_message_bytes='big'",
        "[nope]: unknown section",
        "LORAD_QUOTAS_MAX_SAMPLES",
    ):
        assert needle in errs, needle
    assert len(ei.value.errors) == 8


def test_file_probe_needs_a_file() -> None:
    with pytest.raises(ConfigError, match="probe_file"):
        build_config({"conditions": {"probe": "file"}}, env={})


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_config(bad, env={})


def test_data_dir_defaults() -> None:
    assert default_data_dir({"HOME": "/h"}) == Path("/h/.local/share/lorad")
    assert default_data_dir({"HOME": "/h", "XDG_DATA_HOME": "/x"}) == Path("/x/lorad")
    root = "/data/data/com.termux/files"
    termux = {"HOME": f"{root}/home", "PREFIX": f"{root}/usr", "XDG_DATA_HOME": "/x"}
    assert default_data_dir(termux) == Path("/data/data/com.termux/files/home/.local/share/lorad")
    cfg = build_config({"storage": {"data_dir": "/d"}}, env={})
    assert cfg.data_dir == Path("/d") and cfg.socket_path == Path("/d/run/lorad.sock")
