"""Device readings (battery, charger, temperature, idle) and the training conditions they decide."""

from lorad.server.device.conditions import Verdict, evaluate
from lorad.server.device.probes import FileProbe, Probe, Readings, SysfsProbe, TermuxProbe, make_probe

__all__ = ["FileProbe", "Probe", "Readings", "SysfsProbe", "TermuxProbe", "Verdict", "evaluate", "make_probe"]
