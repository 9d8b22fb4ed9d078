"""Metric logging: the backend interface (``base``), the core's backends (``tensorboard``, ``mlflow``, ``wandb``),
choosing them from the config (``select``) and feeding them from the loop (``fanout``). See docs/logging.md.

Importing this package imports no torch and no backend package.
"""

from automodel.training.logging.base import (
    FAILED,
    STOPPED,
    SUCCESS,
    LoggerContext,
    MetricLogger,
    flatten,
    numeric_items,
    train_scalars,
    validation_scalars,
)
from automodel.training.logging.fanout import MetricLoggers
from automodel.training.logging.select import BackendSpec, module_available, resolve_backends

__all__ = ["FAILED", "STOPPED", "SUCCESS", "BackendSpec", "LoggerContext", "MetricLogger", "MetricLoggers",
           "flatten", "module_available", "numeric_items", "resolve_backends", "train_scalars", "validation_scalars"]
