"""LoRA training: samples → packed batches → layer-wise overlapped AdamW → exact checkpoints, as one recipe.

Modules: ``config`` (TrainConfig, ConfigError), ``data`` (samples, prepare, DataError), ``packing`` (pack,
BatchStream), ``schedule`` (lr_at), ``optim`` (LayerwiseAdamW), ``trainer`` (Trainer, Progress, TrainResult),
``checkpoint`` (save/list/load, CheckpointError), ``recipe`` (run_recipe: setup → train → save → cleanup).

The package imports nothing itself: ``lorad.server.engine.api`` is the engine's one public surface, and importing
``training.config`` (as the daemon's records do) must not import torch through this file.
"""
