"""The device profile (phone, laptop, server): which conditions gate training here, chosen by config or detected."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SERVER_HINT = (
    'if this machine runs on mains power, set `profile = "server"` under [device] in the daemon config '
    "(or LORAD_DEVICE_PROFILE=server) and restart `lorad serve`"
)


@dataclass(frozen=True)
class DeviceProfile:
    """The profile in force (phone, laptop or server) and why it was chosen."""

    name: str
    reason: str

    @property
    def gates_power(self) -> bool:
        """Whether charger and battery level matter (not on mains-powered machines)."""
        return self.name != "server"

    @property
    def needs_temperature(self) -> bool:
        """Whether an unreadable temperature blocks training (phones only: laptops often expose none)."""
        return self.name == "phone"

    @property
    def gates_temperature(self) -> bool:
        """Whether a readable temperature above the limit blocks training (servers cool themselves)."""
        return self.name != "server"


def _has_battery(sysfs_class: Path) -> bool:
    ps = sysfs_class / "power_supply"
    try:
        devices = list(ps.iterdir()) if ps.is_dir() else []
    except OSError:
        return False
    for dev in devices:
        try:
            if (dev / "type").read_text().strip().lower() == "battery":
                return True
        except OSError:
            continue
    return False


def resolve_profile(
    configured: str,
    probe: str,
    sysfs_class: Path = Path("/sys/class"),
    which: Callable[[str], str | None] = shutil.which,
) -> DeviceProfile:
    """The profile for ``[device] profile`` = ``configured``; "auto" looks at what the machine has.

    Args:
        configured: one of PROFILES.
        probe: ``conditions.probe``; a "file" probe simulates a battery-powered device (tests, the demo).
        sysfs_class: where power supplies are listed (tests point it elsewhere).
        which: finds ``termux-battery-status`` on PATH.
    """
    if configured != "auto":
        return DeviceProfile(configured, "set in the daemon config ([device] profile)")
    if probe == "file":
        return DeviceProfile("phone", "auto: conditions.probe = 'file' simulates a battery-powered device")
    if which("termux-battery-status"):
        return DeviceProfile("phone", "auto: termux-battery-status is installed (Android)")
    if _has_battery(sysfs_class):
        return DeviceProfile("laptop", f"auto: a battery is listed in {sysfs_class / 'power_supply'}")
    return DeviceProfile(
        "server", f"auto: no battery in {sysfs_class / 'power_supply'} and no termux-battery-status: on mains power"
    )
