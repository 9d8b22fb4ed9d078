"""MLflow: params, per-step metrics and the final model as an artifact (``pip install automodel-core[mlflow]``)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from automodel.training.logging.base import (
    FAILED,
    STOPPED,
    SUCCESS,
    LoggerContext,
    MetricLogger,
    flatten,
    train_scalars,
    validation_scalars,
)


@dataclass
class MLflowSettings:
    tracking_uri: str | None = field(default=None, metadata={
        "help": "tracking server or store (default $MLFLOW_TRACKING_URI, else file:<checkpoint_dir>/mlruns)"})
    experiment_name: str = field(default="automodel", metadata={"help": "experiment the run is grouped under"})
    run_name: str | None = field(default=None, metadata={"help": "the run's name (default: MLflow picks one)"})
    artifact_location: str | None = field(default=None, metadata={
        "help": "artifact root of a newly created experiment (default: the store's)"})
    tags: dict = field(default_factory=dict, metadata={"help": "run tags"})
    log_model: bool = field(default=True, metadata={"help": "log the final HF model directory as artifact 'model'"})


_MLFLOW_STATUS = {SUCCESS: "FINISHED", FAILED: "FAILED", STOPPED: "KILLED"}
_MLFLOW_BAD_KEY = re.compile(r"[^\w.\- ]")


def _is_file_store(uri: str) -> bool:
    scheme = uri.split(":", 1)[0] if re.match(r"^[A-Za-z][\w+.-]*:", uri) else ""
    return scheme in ("", "file")


class MLflowLogger(MetricLogger):
    """Params (the masked config, dotted keys), per-step metrics and the final model as an artifact."""

    requires = ("mlflow",)
    install_hint = "pip install automodel-core[mlflow]"
    settings_schema = MLflowSettings

    def __init__(self, settings: MLflowSettings, context: LoggerContext):
        super().__init__(settings, context)
        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            (context.checkpoint_dir / "mlruns").resolve().as_uri()
        if _is_file_store(uri):
            # MLflow 3 refuses the file store unless opted in; naming a file: URI (or the default) is that choice.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(settings.experiment_name,
                                                          artifact_location=settings.artifact_location)
        tags = {str(k): str(v) for k, v in settings.tags.items()}
        tags.setdefault("automodel.recipe", context.recipe)
        run = self.client.create_run(experiment_id, run_name=settings.run_name or None, tags=tags)
        self.run_id = run.info.run_id
        context.log(f"mlflow: run {run.info.run_name} ({self.run_id}) in experiment "
                    f"'{settings.experiment_name}' at {uri}")

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = {}
        for key, value in flatten(config).items():
            key = _MLFLOW_BAD_KEY.sub("_", key)[:250]
            params[key] = value if len(value) <= 6000 else value[:5997] + "..."
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])

    def _metrics(self, values: dict[str, float], step: int, timestamp: Any) -> None:
        from mlflow.entities import Metric

        ms = int(1000 * (timestamp if isinstance(timestamp, (int, float)) else time.time()))
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def log_train(self, sample: dict[str, Any], step: int) -> None:
        self._metrics(train_scalars(sample), step, sample.get("timestamp"))

    def log_validation(self, record: dict[str, Any], step: int) -> None:
        self._metrics(validation_scalars(record), step, record.get("timestamp"))

    def log_model(self, model_dir: Path) -> None:
        if self.settings.log_model and Path(model_dir).is_dir():
            self.client.log_artifacts(self.run_id, str(model_dir), artifact_path="model")
            self.context.log(f"mlflow: logged {model_dir} as artifact 'model' of run {self.run_id}")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS.get(status, "FAILED"))
