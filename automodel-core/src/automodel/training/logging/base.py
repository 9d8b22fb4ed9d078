"""The interface a metric logging backend implements, and what every backend logs.

The shared loop feeds every configured backend from rank 0 only, at the points where it writes ``training.jsonl``
and ``validation.jsonl``: ``log_config`` once when training starts (the config with secrets masked),
``log_train`` per logged step, ``log_validation`` per validation record, ``log_model`` with the final HF model
directory, and ``close(status)`` when the loop ends, whether it finished, failed or was stopped by a signal.

Configuration (validated before anything is built; see docs/logging.md)::

    logging:
      backends: [tensorboard, mlflow]          # what to use
      tensorboard: {log_dir: runs/tb}          # per-backend settings (giving them also turns the backend on)
      mlflow: {tracking_uri: file:./mlruns, experiment_name: exp}

Upstream-style top-level ``wandb:`` / ``mlflow:`` sections mean the same as ``logging.wandb`` / ``logging.mlflow``;
``enable: false`` in any of them turns that backend off.

A backend is registered by a plugin with ``loggers.add(name, "pkg.module.Factory")``. The factory is called as
``factory(settings, context)`` and returns a :class:`MetricLogger`. Optional attributes on the factory make
validation precise: ``requires`` (top-level modules that must be importable), ``install_hint`` (how to get them)
and ``settings_schema`` (a dataclass: the settings' keys, types and defaults; the factory then receives an
instance of it instead of the mapping). Importing this module imports no torch and no backend package.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

SUCCESS, FAILED, STOPPED = "success", "failed", "stopped"  # close(status)


@dataclass(frozen=True)
class LoggerContext:
    """What a backend may use besides its own settings."""

    checkpoint_dir: Path  # the run's directory (default home for event files and run directories)
    recipe: str  # dotted path of the recipe class
    log: Callable[[str], None] = print  # one-line messages to the user (stderr, rank 0)


class MetricLogger:
    """Base class of a metric logging backend; every method is optional."""

    requires: ClassVar[tuple[str, ...]] = ()  # top-level modules that must be importable (checked at validation)
    install_hint: ClassVar[str | None] = None  # how to install them, e.g. "pip install automodel-core[wandb]"
    settings_schema: ClassVar[type | None] = None  # a dataclass of the backend's settings

    def __init__(self, settings: Any, context: LoggerContext):
        self.settings, self.context = settings, context

    def log_config(self, config: dict[str, Any]) -> None:
        """Called once when training starts, with the run's config (overrides applied, secrets masked)."""

    def log_train(self, sample: dict[str, Any], step: int) -> None:
        """A MetricsSample as written to training.jsonl (step, epoch, loss, grad_norm, lr, mem, tps, mfu, ...)."""

    def log_validation(self, record: dict[str, Any], step: int) -> None:
        """A validation record as written to validation.jsonl (name, val_loss, num_label_tokens, extras)."""

    def log_model(self, model_dir: Path) -> None:
        """The final checkpoint's HF model directory (``<checkpoint>/model``), after the last step."""

    def close(self, status: str) -> None:
        """The loop ended: ``success``, ``failed`` (an exception propagates) or ``stopped`` (SIGINT/SIGTERM)."""


# ---- what the backends log ------------------------------------------------------------------------------------

def numeric_items(record: dict[str, Any], skip: tuple[str, ...] = ("step", "timestamp", "name")) -> dict[str, float]:
    """The record's finite numbers (bools and None left out): what becomes a scalar."""
    return {k: float(v) for k, v in record.items()
            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def train_scalars(sample: dict[str, Any]) -> dict[str, float]:
    """``train/<field>`` for every numeric MetricsSample field (the step is the x-axis, the timestamp the time)."""
    return {f"train/{k}": v for k, v in numeric_items(sample).items()}


def validation_scalars(record: dict[str, Any]) -> dict[str, float]:
    """``val/<metric>`` for the set named ``validation``, ``val/<name>/<metric>`` for ``validation_dataset_<name>``.

    Every numeric metric of the record (val_loss, num_label_tokens, a recipe's extras such as recall@k); the
    step is the x-axis, so step, epoch and timestamp are not metrics here.
    """
    name = record.get("name", "validation")
    prefix = "val/" if name == "validation" else f"val/{name}/"
    return {prefix + k: v for k, v in numeric_items(record, skip=("step", "epoch", "timestamp", "name")).items()}


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys; lists and scalars as their text (``null`` for None)."""
    if isinstance(data, dict) and data:
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if data is None:
        text = "null"
    elif isinstance(data, bool):
        text = "true" if data else "false"
    else:
        text = str(data)
    return {prefix: text} if prefix else {}
