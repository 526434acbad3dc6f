"""The device profile: auto detection from what the machine has, and the gates each profile applies."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorad.server.config import ConfigError, build_config
from lorad.server.device.conditions import evaluate
from lorad.server.device.probes import Readings
from lorad.server.device.profile import DeviceProfile, resolve_profile
from lorad.server.records import Blocked, Requirements

DEFAULT_REQ = Requirements(require_charging=True, min_battery_percent=50, max_temperature_celsius=40.0,
                           require_idle=False)  # fmt: skip
NO_SENSORS = Readings(source="sysfs")


def _supply(root: Path, name: str, kind: str) -> None:
    d = root / "power_supply" / name
    d.mkdir(parents=True)
    (d / "type").write_text(kind + "\n")


def test_auto_is_server_without_battery_laptop_with_one_phone_with_termux(tmp_path: Path) -> None:
    no_termux = lambda _name: None  # noqa: E731
    p = resolve_profile("auto", "auto", tmp_path / "none", no_termux)
    assert p.name == "server" and "no battery" in p.reason and "termux-battery-status" in p.reason
    _supply(tmp_path, "AC", "Mains")
    assert resolve_profile("auto", "sysfs", tmp_path, no_termux).name == "server"
    _supply(tmp_path, "BAT0", "Battery")
    assert resolve_profile("auto", "sysfs", tmp_path, no_termux).name == "laptop"
    termux = resolve_profile("auto", "auto", tmp_path / "none", lambda _n: "/usr/bin/termux-battery-status")
    assert termux.name == "phone" and "termux" in termux.reason
    assert resolve_profile("auto", "file", tmp_path / "none", no_termux).name == "phone"
    declared = resolve_profile("phone", "auto", tmp_path / "none", no_termux)
    assert declared.name == "phone" and "[device] profile" in declared.reason


def test_server_trains_without_sensors_phone_waits_and_says_how_to_change_it() -> None:
    assert evaluate(NO_SENSORS, DEFAULT_REQ, DeviceProfile("server", "auto")).ok
    v = evaluate(NO_SENSORS, DEFAULT_REQ, DeviceProfile("phone", "set in the daemon config ([device] profile)"))
    assert v.reasons == (Blocked.CONDITIONS_UNKNOWN,)
    assert "charger state, temperature" in v.detail and "device profile phone" in v.detail
    assert 'profile = "server"' in v.hint and "LORAD_DEVICE_PROFILE=server" in v.hint
    assert v.hint in v.explained and v.detail in v.explained


def test_laptop_gates_on_power_but_tolerates_a_missing_thermometer() -> None:
    laptop = DeviceProfile("laptop", "auto")
    on_battery = Readings(battery_percent=30, charging=False, source="sysfs")
    v = evaluate(on_battery, DEFAULT_REQ, laptop)
    assert v.reasons == (Blocked.NOT_CHARGING,) and "--no-require-charging" in v.hint
    assert evaluate(Readings(battery_percent=30, charging=True, source="sysfs"), DEFAULT_REQ, laptop).ok
    hot = Readings(charging=True, temperature_celsius=70.0, source="sysfs")
    assert evaluate(hot, DEFAULT_REQ, laptop).first is Blocked.TOO_HOT
    # A server is on mains power and cools itself: neither the charger nor a warm CPU stops it.
    assert evaluate(hot, DEFAULT_REQ, DeviceProfile("server", "auto")).ok
    busy = Readings(idle=False, source="file")
    assert evaluate(busy, Requirements(True, 50, 40.0, True), DeviceProfile("server", "x")).first is Blocked.DEVICE_BUSY


def test_config_profile_is_validated_and_env_overridable() -> None:
    assert build_config({}, env={}).device.profile == "auto"
    assert build_config({"device": {"profile": "phone"}}, env={"LORAD_DEVICE_PROFILE": "server"}).device.profile == (
        "server"
    )
    with pytest.raises(ConfigError, match=r"device.profile='desk': must be one of auto, phone, laptop, server"):
        build_config({"device": {"profile": "desk"}}, env={})
