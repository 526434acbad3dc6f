"""Jobs that start from a stored adapter: the adapter's shape wins; a different explicit LoRA shape is refused."""

from __future__ import annotations

import dataclasses

from lorad.server.engine.api import TrainConfig
from lorad.server.errors import InvalidArgument
from lorad.server.services import Services


def with_init_adapter(s: Services, app_id: str, params: TrainConfig, *, base_model: str, init_adapter_id: str,
                      lora_given: bool) -> TrainConfig:  # fmt: skip
    """``params`` with the init adapter's rank, alpha and targets (unchanged when there is no init adapter).

    Raises:
        NotFound: the adapter is absent or another app's (``config.init_adapter_id``).
        InvalidArgument: the adapter is for another base model, or ``config.lora`` is set and differs from it.
    """
    if not init_adapter_id:
        return params
    rec = s.adapters.get(app_id, init_adapter_id)
    base = s.models.entry(base_model).name
    if rec.base_model != base:
        raise InvalidArgument(
            "config.init_adapter_id", f"adapter is for base model {rec.base_model!r}, the job trains {base!r}"
        )
    if lora_given and (params.rank, params.alpha, sorted(params.targets)) != (
        rec.rank,
        rec.alpha,
        sorted(rec.target_modules),
    ):
        raise InvalidArgument(
            "config.lora",
            f"differs from the init adapter's (rank {rec.rank}, alpha {rec.alpha}, "
            f"targets {list(rec.target_modules)}); leave it unset",
        )
    return dataclasses.replace(params, rank=rec.rank, alpha=rec.alpha, targets=tuple(rec.target_modules))
