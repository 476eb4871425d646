"""Training loop, distributed setup, metrics and checkpoints."""
