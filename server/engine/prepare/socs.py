"""Snapdragon target SoCs: marketing name and part number -> QNN ``soc_model`` id and ``htp_arch``."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SocTarget:
    """One target SoC.

    Attributes:
        chip: Qualcomm part number, e.g. "SM8650".
        name: marketing name, e.g. "Snapdragon 8 Gen 3".
        soc_model: QNN ``soc_model`` provider option (the QNN_SOC_MODEL_* id from the QNN SDK's QnnTypes.h).
        htp_arch: QNN ``htp_arch`` provider option (Hexagon generation, e.g. "75" for V75).
        soc_ids: values of /sys/devices/soc0/soc_id seen on phones with this chip (used for a friendly name only).
    """

    chip: str
    name: str
    soc_model: str
    htp_arch: str
    soc_ids: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``"Snapdragon 8 Gen 3 (SM8650, soc_model 57, HTP v75)"``."""
        return f"{self.name} ({self.chip}, soc_model {self.soc_model}, HTP v{self.htp_arch})"


# soc_model ids and HTP generations: ExecuTorch's Qualcomm backend table (pytorch/executorch,
# backends/qualcomm/serialization/qc_schema.py, QcomChipset + _soc_info_table), whose ids are the
# QNN_SOC_MODEL_* constants of the QNN SDK's QnnTypes.h; the V81 parts from the same file (SM8850 added in
# executorch PR #15987, "Snapdragon 8 Elite Gen 5"). soc_id values (/sys/devices/soc0/soc_id) match the ones
# lorad.kernels.detect maps (519 SM8550, 557 SM8650, 618 SM8750).
SOCS: tuple[SocTarget, ...] = (
    SocTarget("SM8350", "Snapdragon 888", "30", "68"),
    SocTarget("SM8450", "Snapdragon 8 Gen 1", "36", "69"),
    SocTarget("SM8475", "Snapdragon 8+ Gen 1", "42", "69"),
    SocTarget("SM8550", "Snapdragon 8 Gen 2", "43", "73", ("519",)),
    SocTarget("SM8635", "Snapdragon 8s Gen 3", "68", "73"),
    SocTarget("SM8650", "Snapdragon 8 Gen 3", "57", "75", ("557",)),
    SocTarget("SM8735", "Snapdragon 8s Gen 4", "85", "79"),
    SocTarget("SM8750", "Snapdragon 8 Elite", "69", "79", ("618",)),
    SocTarget("SM8845", "Snapdragon 8 Gen 5", "97", "81"),
    SocTarget("SM8850", "Snapdragon 8 Elite Gen 5", "87", "81"),
    SocTarget("QCM6490", "QCM6490 / QCS6490 (Qualcomm Linux)", "93", "68"),
)


def _norm(s: str) -> str:
    s = s.lower().replace("snapdragon", "").replace("+", "plus")
    return re.sub(r"[^a-z0-9]", "", s)


def _aliases(t: SocTarget) -> set[str]:
    return {_norm(t.chip), _norm(t.name), _norm(t.name.split("(")[0]), _norm(f"sd{t.name}")}


def resolve_soc(name: str) -> SocTarget:
    """Find a target by part number or marketing name, case and spacing ignored.

    Args:
        name: e.g. "SM8650", "8 Gen 3", "snapdragon-8-elite", "8+ Gen 1".

    Returns:
        The matching SocTarget.

    Raises:
        ValueError: unknown name; the message lists every known target.
    """
    key = _norm(name)
    for t in SOCS:
        if key and key in _aliases(t):
            return t
    known = "; ".join(f"{t.chip} = {t.name}" for t in SOCS)
    raise ValueError(f"unknown target SoC {name!r}; choose a part number or name from: {known}")


def soc_for_options(soc_model: str, htp_arch: str) -> SocTarget | None:
    """The known target with these QNN options, or None (used to name a device's SoC in error messages)."""
    for t in SOCS:
        if t.soc_model == soc_model and t.htp_arch == htp_arch:
            return t
    return None


def describe_options(soc_model: str, htp_arch: str) -> str:
    """A readable name for a (soc_model, htp_arch) pair, known or not."""
    t = soc_for_options(soc_model, htp_arch)
    return t.label if t else f"unknown SoC (soc_model {soc_model or '?'}, HTP v{htp_arch or '?'})"
