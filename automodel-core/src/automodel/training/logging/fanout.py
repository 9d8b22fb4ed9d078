"""The run's backends together: started when training starts, fed by the loop on rank 0, closed when it ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel.config.secrets import mask_secrets
from automodel.errors import AutomodelError
from automodel.training.logging.base import FAILED, LoggerContext, MetricLogger
from automodel.training.logging.select import BackendSpec


class MetricLoggers:
    """The run's backends: started when training starts, fed by the loop, closed when it ends.

    A backend that fails to start stops the run before its first step (the error says which). One that fails
    later is reported once and turned off, so a tracking hiccup never loses the training run.
    """

    def __init__(self, specs: list[BackendSpec], context: LoggerContext):
        self.specs, self.context = list(specs), context
        self.active: list[tuple[str, MetricLogger]] = []

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def open(self, config: dict[str, Any]) -> None:
        """Start every backend and give it the config; secret-looking keys are masked here, for all of them."""
        masked = mask_secrets(config)
        for spec in self.specs:
            try:
                logger = spec.factory(spec.settings, self.context)
                self.active.append((spec.name, logger))
                logger.log_config(masked)
            except Exception as err:
                self.close(FAILED)
                if isinstance(err, AutomodelError):
                    raise
                raise AutomodelError(f"{spec.key}: the {spec.name} logging backend could not start: "
                                     f"{type(err).__name__}: {err}") from err

    def _each(self, method: str, *args: Any) -> None:
        for entry in list(self.active):
            name, logger = entry
            try:
                getattr(logger, method)(*args)
            except Exception as err:  # noqa: BLE001 - metrics are a side channel; the run goes on
                self.context.log(f"logging: the {name} backend failed in {method} ({type(err).__name__}: {err}); "
                                 "it is turned off for the rest of this run")
                self.active.remove(entry)
                try:
                    logger.close(FAILED)
                except Exception:  # noqa: BLE001, S110 - already reported
                    pass

    def log_train(self, sample: dict[str, Any], step: int) -> None:
        self._each("log_train", sample, step)

    def log_validation(self, record: dict[str, Any], step: int) -> None:
        self._each("log_validation", record, step)

    def log_model(self, model_dir: Path) -> None:
        self._each("log_model", Path(model_dir))

    def close(self, status: str) -> None:
        active, self.active = self.active, []
        for name, logger in active:
            try:
                logger.close(status)
            except Exception as err:  # noqa: BLE001 - closing one must not keep the others open
                self.context.log(f"logging: closing the {name} backend failed: {type(err).__name__}: {err}")
