"""One module per pipeline slot (``automodel.training.pipeline.PIPELINE_SLOTS``): its selection, its config checks
and the core's implementations. Every module has ``select(cfg) -> (implementation, config key) | None`` and
``issues(cfg, implementation) -> list[ConfigIssue]``; an implementation is ``fn(ctx, model) -> (model, message)``.
"""
