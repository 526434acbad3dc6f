"""Whether a job may train now, given the readings and its requirements; every failing condition is listed."""

from __future__ import annotations

from dataclasses import dataclass

from lorad.server.device.probes import Readings
from lorad.server.domain import Blocked, Requirements


@dataclass(frozen=True)
class Verdict:
    """The outcome: ``ok`` or the failing reasons with a human-readable detail."""

    reasons: tuple[Blocked, ...]
    detail: str

    @property
    def ok(self) -> bool:
        """True when every condition holds."""
        return not self.reasons

    @property
    def first(self) -> Blocked:
        """The main reason (NONE when ok)."""
        return self.reasons[0] if self.reasons else Blocked.NONE


def evaluate(r: Readings, req: Requirements) -> Verdict:
    """Checks charging/battery, temperature and idleness. An unknown reading that matters means "do not train".

    Idleness is enforced only where the probe can report it (sysfs and termux cannot): a phone without that signal
    would otherwise never train.
    """
    reasons: list[Blocked] = []
    details: list[str] = []
    unknown: list[str] = []
    if req.require_charging:
        if r.charging is None:
            unknown.append("charger state")
        elif not r.charging:
            reasons.append(Blocked.NOT_CHARGING)
            details.append("not charging (charger required)")
    elif not r.charging:
        if r.battery_percent is None:
            unknown.append("battery level")
        elif r.battery_percent < req.min_battery_percent:
            reasons.append(Blocked.BATTERY_LOW)
            details.append(f"battery {r.battery_percent}% < {req.min_battery_percent}%")
    if r.temperature_celsius is None:
        unknown.append("temperature")
    elif r.temperature_celsius > req.max_temperature_celsius:
        reasons.append(Blocked.TOO_HOT)
        details.append(f"temperature {r.temperature_celsius:.1f} °C > {req.max_temperature_celsius:.1f} °C")
    if req.require_idle and r.idle is False:
        reasons.append(Blocked.DEVICE_BUSY)
        details.append("device in use (idle required)")
    if unknown:
        reasons.append(Blocked.CONDITIONS_UNKNOWN)
        details.append(f"cannot read {', '.join(unknown)} from {r.source or 'any probe'}")
    return Verdict(tuple(reasons), "; ".join(details))
