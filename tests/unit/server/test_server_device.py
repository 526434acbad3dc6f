"""Probes (file, sysfs, termux with a hanging command) and the condition verdicts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lorad.server.device.conditions import evaluate
from lorad.server.device.probes import FileProbe, MergedProbe, Readings, SysfsProbe, TermuxProbe
from lorad.server.records import Blocked, Requirements

REQ = Requirements(require_charging=False, min_battery_percent=50, max_temperature_celsius=40.0, require_idle=True)


def test_file_probe_reads_and_treats_bad_input_as_unknown(tmp_path: Path) -> None:
    p = tmp_path / "probe.json"
    p.write_text(json.dumps({"battery_percent": 80, "charging": False, "temperature_celsius": 31.5}))
    r = FileProbe(p).read()
    assert (r.battery_percent, r.charging, r.temperature_celsius, r.idle) == (80, False, 31.5, None)
    assert r.source == f"file:{p}" and r.read_at_ms > 0
    p.write_text("{not json")
    assert FileProbe(p).read().battery_percent is None
    assert FileProbe(tmp_path / "missing").read().charging is None


def test_sysfs_probe_units(tmp_path: Path) -> None:
    bat = tmp_path / "power_supply" / "battery"
    usb = tmp_path / "power_supply" / "usb"
    z0, z1 = tmp_path / "thermal" / "thermal_zone0", tmp_path / "thermal" / "thermal_zone1"
    for d in (bat, usb, z0, z1):
        d.mkdir(parents=True)
    (bat / "type").write_text("Battery\n")
    (bat / "capacity").write_text("67\n")
    (bat / "status").write_text("Discharging\n")
    (bat / "temp").write_text("312\n")  # tenths of a degree
    (usb / "type").write_text("USB\n")
    (usb / "online").write_text("1\n")
    (z0 / "temp").write_text("45500\n")  # millidegrees
    (z1 / "temp").write_text("30000\n")
    r = SysfsProbe(tmp_path).read()
    assert r.battery_percent == 67 and r.charging is True and r.temperature_celsius == 45.5 and r.source == "sysfs"
    empty = SysfsProbe(tmp_path / "nothing").read()
    assert (empty.battery_percent, empty.charging, empty.temperature_celsius) == (None, None, None)


def test_termux_probe_parses_and_times_out(tmp_path: Path) -> None:
    ok = tmp_path / "termux-ok"
    ok.write_text('#!/bin/sh\necho \'{"percentage": 55, "plugged": "PLUGGED_AC", "status": "CHARGING", '
                  '"temperature": 33.1}\'\n')  # fmt: skip
    hang = tmp_path / "termux-hang"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    for f in (ok, hang):
        os.chmod(f, 0o755)
    r = TermuxProbe(2.0, str(ok)).read()
    assert (r.battery_percent, r.charging, r.temperature_celsius) == (55, True, 33.1)
    t0 = time.monotonic()
    r = TermuxProbe(0.3, str(hang)).read()
    assert time.monotonic() - t0 < 5 and r.battery_percent is None and r.charging is None
    assert TermuxProbe(1.0, str(tmp_path / "absent")).read().charging is None
    merged = MergedProbe(TermuxProbe(0.3, str(hang)), FileProbe(tmp_path / "none")).read()
    assert merged.source == "none"


def test_verdicts_list_every_failing_condition() -> None:
    good = Readings(battery_percent=80, charging=False, temperature_celsius=30.0, idle=True, source="t")
    assert evaluate(good, REQ).ok
    v = evaluate(Readings(battery_percent=20, charging=False, temperature_celsius=45.0, idle=False), REQ)
    assert v.reasons == (Blocked.BATTERY_LOW, Blocked.TOO_HOT, Blocked.DEVICE_BUSY)
    assert "battery 20% < 50%" in v.detail and "45.0 °C > 40.0 °C" in v.detail
    # Charging lifts the battery floor; an unknown temperature blocks.
    v = evaluate(Readings(battery_percent=5, charging=True, source="t"), REQ)
    assert v.reasons == (Blocked.CONDITIONS_UNKNOWN,) and "temperature" in v.detail
    charging_required = Requirements(True, 50, 40.0, False)
    assert evaluate(good, charging_required).first is Blocked.NOT_CHARGING
    assert evaluate(Readings(temperature_celsius=30.0), charging_required).first is Blocked.CONDITIONS_UNKNOWN
    # Idleness is only enforced where the probe can tell.
    assert evaluate(Readings(battery_percent=80, charging=True, temperature_celsius=30.0, idle=None), REQ).ok
