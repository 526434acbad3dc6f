"""Probes for device readings: termux-battery-status (with a timeout), /sys, and a JSON file for tests and demos."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Readings:
    """One set of readings; None means the value could not be read (treated as "do not train")."""

    battery_percent: int | None = None
    charging: bool | None = None
    temperature_celsius: float | None = None
    idle: bool | None = None
    source: str = ""
    read_at_ms: int = 0


class Probe(Protocol):
    """Something that reads the device; must not block longer than its own timeout."""

    def read(self) -> Readings:
        """Takes one set of readings."""
        ...


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class FileProbe:
    """Reads ``{"battery_percent": 80, "charging": true, "temperature_celsius": 31.5, "idle": true}`` from a file.

    A missing key, a missing file or bad JSON gives unknown readings (never an exception).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> Readings:
        """Reads the file now."""
        src = f"file:{self.path}"
        try:
            d = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return Readings(source=src, read_at_ms=_now_ms())
        if not isinstance(d, dict):
            return Readings(source=src, read_at_ms=_now_ms())
        b, c, t, i = d.get("battery_percent"), d.get("charging"), d.get("temperature_celsius"), d.get("idle")
        return Readings(
            battery_percent=int(b) if isinstance(b, (int, float)) and not isinstance(b, bool) else None,
            charging=c if isinstance(c, bool) else None,
            temperature_celsius=float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None,
            idle=i if isinstance(i, bool) else None,
            source=src,
            read_at_ms=_now_ms(),
        )


class TermuxProbe:
    """Runs ``termux-battery-status`` (Termux:API). It hangs when the API app is missing, so it has a timeout."""

    def __init__(self, timeout_s: float = 5.0, command: str = "termux-battery-status") -> None:
        self.timeout_s = timeout_s
        self.command = command

    def read(self) -> Readings:
        """Runs the command once; a timeout or bad output gives unknown readings."""
        src = "termux-battery-status"
        try:
            out = subprocess.run(
                [self.command], capture_output=True, timeout=self.timeout_s, check=True, text=True
            ).stdout
            d = json.loads(out)
        except subprocess.TimeoutExpired:
            log.warning("probe_timeout", probe=src, timeout_s=self.timeout_s)
            return Readings(source=src, read_at_ms=_now_ms())
        except (OSError, subprocess.CalledProcessError, ValueError) as exc:
            log.warning("probe_failed", probe=src, error=type(exc).__name__)
            return Readings(source=src, read_at_ms=_now_ms())
        pct, plugged, status, temp = d.get("percentage"), d.get("plugged"), d.get("status"), d.get("temperature")
        charging: bool | None = None
        if isinstance(plugged, str):
            charging = plugged.upper() not in ("UNPLUGGED", "")
        elif isinstance(status, str):
            charging = status.upper() in ("CHARGING", "FULL")
        return Readings(
            battery_percent=int(pct) if isinstance(pct, (int, float)) else None,
            charging=charging,
            temperature_celsius=float(temp) if isinstance(temp, (int, float)) else None,
            source=src,
            read_at_ms=_now_ms(),
        )


class SysfsProbe:
    """Reads /sys/class/power_supply (capacity, status, online, temp in 0.1 °C) and /sys/class/thermal (m°C)."""

    def __init__(self, root: Path = Path("/sys/class")) -> None:
        self.root = root

    @staticmethod
    def _read(p: Path) -> str | None:
        try:
            return p.read_text().strip()
        except OSError:
            return None

    def read(self) -> Readings:
        """Reads the files now; anything absent stays unknown."""
        battery: int | None = None
        charging: bool | None = None
        temps: list[float] = []
        ps = self.root / "power_supply"
        for dev in sorted(ps.iterdir()) if ps.is_dir() else []:
            kind = (self._read(dev / "type") or "").lower()
            if kind == "battery":
                cap = self._read(dev / "capacity")
                if cap and cap.lstrip("-").isdigit():
                    battery = int(cap)
                status = (self._read(dev / "status") or "").lower()
                if status:
                    charging = (charging or False) or status in ("charging", "full")
                t = self._read(dev / "temp")
                if t and t.lstrip("-").isdigit():
                    temps.append(int(t) / 10.0)  # power_supply temp is in tenths of a degree
            elif kind in ("mains", "usb", "wireless", "usb_pd", "usb_c"):
                online = self._read(dev / "online")
                if online in ("0", "1"):
                    charging = (charging or False) or online == "1"
        th = self.root / "thermal"
        for zone in sorted(th.glob("thermal_zone*")) if th.is_dir() else []:
            t = self._read(zone / "temp")
            if t and t.lstrip("-").isdigit():
                temps.append(int(t) / 1000.0)  # thermal zones report millidegrees
        return Readings(battery, charging, max(temps) if temps else None, None, "sysfs", _now_ms())


class MergedProbe:
    """Takes each reading from the first probe that knows it (termux first, then sysfs)."""

    def __init__(self, *probes: Probe) -> None:
        self.probes = probes

    def read(self) -> Readings:
        """Reads every probe and merges the known values."""
        out = Readings(read_at_ms=_now_ms())
        names = []
        for p in self.probes:
            r = p.read()
            used = False
            for f in ("battery_percent", "charging", "temperature_celsius", "idle"):
                if getattr(out, f) is None and getattr(r, f) is not None:
                    out = replace(out, **{f: getattr(r, f)})
                    used = True
            if used:
                names.append(r.source)
        return replace(out, source="+".join(names) or "none")


def make_probe(kind: str, probe_file: str = "", termux_timeout_s: float = 5.0) -> Probe:
    """The probe named in config ``conditions.probe``: "file", "termux", "sysfs" or "auto"."""
    if kind == "file":
        return FileProbe(Path(probe_file))
    if kind == "termux":
        return TermuxProbe(termux_timeout_s)
    if kind == "sysfs":
        return SysfsProbe()
    if shutil.which("termux-battery-status"):
        return MergedProbe(TermuxProbe(termux_timeout_s), SysfsProbe())
    return SysfsProbe()
