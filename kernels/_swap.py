"""Find and swap the frozen linears inside a model, wherever modules hold them (LoRALinear, wrappers, heads)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from lorad.kernels.frozen import FrozenLinear
from lorad.kernels.lora import LoRALinear

Site = tuple[nn.Module, str]  # (module, attribute name) that references one frozen linear


def _frozen_attrs(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, Any]]:
    for mod_name, mod in model.named_modules():
        for attr, val in vars(mod).items():
            if attr.startswith("_") or isinstance(val, nn.Module):
                continue
            if isinstance(val, FrozenLinear):
                yield mod_name, mod, attr, val


def frozen_sites(model: nn.Module, names: Iterator[str] | list[str]) -> dict[str, tuple[Any, list[Site]]]:
    """Map each requested layer name to (its frozen linear, every (module, attr) that references it).

    A name is either a LoRALinear's module name (``model.named_modules()``) or a frozen linear's own ``name`` (the
    HF module name lorad's model builder gives it, e.g. ``model.layers.0.mlp.up_proj`` or ``lm_head``). One frozen
    object is often held twice (the model's projection wrapper and its LoRALinear); both references are swapped,
    so calls that bypass the LoRALinear (a chunked loss over the lm_head) see the swap too.

    Raises:
        ValueError: a name that matches no frozen linear in the model.
    """
    mods = dict(model.named_modules())
    by_obj: dict[int, list[Site]] = {}
    by_name: dict[str, Any] = {}
    for _, mod, attr, fl in _frozen_attrs(model):
        by_obj.setdefault(id(fl), []).append((mod, attr))
        if getattr(fl, "name", ""):
            by_name.setdefault(fl.name, fl)
    out: dict[str, tuple[Any, list[Site]]] = {}
    for n in names:
        lora = mods.get(n)
        fl = lora.frozen if isinstance(lora, LoRALinear) else by_name.get(n)
        if fl is None:
            raise ValueError(f"{n!r} is neither a LoRALinear module nor a frozen linear's name in the model")
        out[n] = (fl, by_obj.get(id(fl), []))
    return out


def set_frozen(sites: list[Site], frozen: Any) -> None:
    """Point every site at ``frozen``."""
    for mod, attr in sites:
        setattr(mod, attr, frozen)


def swap_all(sites: Mapping[str, tuple[Any, list[Site]]], frozen: Mapping[str, Any]) -> None:
    """Point each named layer's sites at ``frozen[name]`` (names absent from ``frozen`` are left alone)."""
    for n, (_, s) in sites.items():
        if n in frozen:
            set_frozen(s, frozen[n])
