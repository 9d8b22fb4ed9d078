"""The shared training engine: the one loop, its default builders, the pipeline and checkpointing."""
