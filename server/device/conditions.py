"""Whether a job may train now, given the readings and its requirements; every failing condition is listed."""

from __future__ import annotations

from dataclasses import dataclass

from lorad.server.device.probes import Readings
from lorad.server.device.profile import SERVER_HINT, DeviceProfile
from lorad.server.records import Blocked, Requirements

PHONE = DeviceProfile("phone", "default")


@dataclass(frozen=True)
class Verdict:
    """The outcome: ``ok`` or the failing reasons with a human-readable detail and how to change the outcome."""

    reasons: tuple[Blocked, ...]
    detail: str
    hint: str = ""

    @property
    def explained(self) -> str:
        """The detail followed by the hint, for a job's blocked_detail."""
        return f"{self.detail}; to change it: {self.hint}" if self.hint else self.detail

    @property
    def ok(self) -> bool:
        """True when every condition holds."""
        return not self.reasons

    @property
    def first(self) -> Blocked:
        """The main reason (NONE when ok)."""
        return self.reasons[0] if self.reasons else Blocked.NONE


def evaluate(r: Readings, req: Requirements, profile: DeviceProfile = PHONE) -> Verdict:
    """Checks charging/battery, temperature and idleness as the device profile says; lists every failing condition.

    An unknown reading that the profile needs means "do not train", with a hint naming the setting that changes
    it. A server (mains power) has no charger, battery or temperature gate. Idleness is enforced only where the
    probe can report it (sysfs and termux cannot): a phone without that signal would otherwise never train.
    """
    reasons: list[Blocked] = []
    details: list[str] = []
    hints: list[str] = []
    unknown: list[str] = []
    if not profile.gates_power:
        pass
    elif req.require_charging:
        if r.charging is None:
            unknown.append("charger state")
        elif not r.charging:
            reasons.append(Blocked.NOT_CHARGING)
            details.append("not charging (charger required)")
            hints.append("plug in the charger, or create the job with `lorad train … --no-require-charging`")
    elif not r.charging:
        if r.battery_percent is None:
            unknown.append("battery level")
        elif r.battery_percent < req.min_battery_percent:
            reasons.append(Blocked.BATTERY_LOW)
            details.append(f"battery {r.battery_percent}% < {req.min_battery_percent}%")
            hints.append("plug in the charger, or lower the limit with `lorad train … --min-battery PERCENT`")
    if not profile.gates_temperature:
        pass
    elif r.temperature_celsius is None:
        if profile.needs_temperature:
            unknown.append("temperature")
    elif r.temperature_celsius > req.max_temperature_celsius:
        reasons.append(Blocked.TOO_HOT)
        details.append(f"temperature {r.temperature_celsius:.1f} °C > {req.max_temperature_celsius:.1f} °C")
        hints.append("wait until the device cools down, or raise the limit with `lorad train … --max-temp CELSIUS`")
    if req.require_idle and r.idle is False:
        reasons.append(Blocked.DEVICE_BUSY)
        details.append("device in use (idle required)")
        hints.append("leave the device idle, or create the job with `lorad train … --no-require-idle`")
    if unknown:
        reasons.append(Blocked.CONDITIONS_UNKNOWN)
        details.append(
            f"cannot read {', '.join(unknown)} from {r.source or 'any probe'} (device profile {profile.name}: "
            f"{profile.reason})"
        )
        hints.append(SERVER_HINT)
    return Verdict(tuple(reasons), "; ".join(details), "; ".join(hints))
