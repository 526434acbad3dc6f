"""LoRA training: samples → packed batches → layer-wise overlapped AdamW → exact checkpoints, as one recipe.

Public surface:
- ``TrainConfig``, ``ConfigError`` (config)
- ``TextSample``, ``ChatSample``, ``Message``, ``prepare``, ``PreparedData``, ``DataReport``, ``DataError`` (data)
- ``pack``, ``BatchStream`` (packing); ``lr_at`` (schedule); ``LayerwiseAdamW`` (optim)
- ``Trainer``, ``Progress``, ``TrainResult``, ``PhaseCallback`` (trainer; ``on_phase(phase, fraction)``)
- ``checkpoint`` module (save/list/load, CheckpointError)
- ``run_recipe``, ``RecipeResult`` (recipe: setup → train → save → cleanup)
"""

from lorad.server.engine.training import checkpoint
from lorad.server.engine.training.config import ConfigError, TrainConfig
from lorad.server.engine.training.data import (
    ChatSample,
    DataError,
    DataReport,
    Message,
    PreparedData,
    TextSample,
    prepare,
)
from lorad.server.engine.training.optim import LayerwiseAdamW
from lorad.server.engine.training.packing import BatchStream, pack
from lorad.server.engine.training.recipe import RecipeResult, run_recipe
from lorad.server.engine.training.schedule import lr_at
from lorad.server.engine.training.trainer import PhaseCallback, Progress, Trainer, TrainResult

__all__ = [
    "BatchStream",
    "ChatSample",
    "ConfigError",
    "DataError",
    "DataReport",
    "LayerwiseAdamW",
    "Message",
    "PhaseCallback",
    "PreparedData",
    "Progress",
    "RecipeResult",
    "TextSample",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "checkpoint",
    "lr_at",
    "pack",
    "prepare",
    "run_recipe",
]
