"""Building blocks for models that do not fit in one process: device mesh, meta-device materialisation, mixed
precision, activation checkpointing and sharded checkpoints (each module imports torch; the CLI never imports them)."""
