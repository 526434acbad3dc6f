"""lorad: on-device LoRA personalization daemon (SDK in `lorad.client`, daemon in `lorad.server`)."""

__version__ = "0.1.0"
