"""The training engine: models, training, adapters and NPU bundle preparation; it never imports the daemon."""
