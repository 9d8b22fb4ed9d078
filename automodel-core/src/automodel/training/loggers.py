"""Metric logging backends (TensorBoard, MLflow, Weights & Biases) and the interface a plugin's backend implements.

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

import importlib.util
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from automodel.config.schema import validate_dataclass
from automodel.config.secrets import mask_secrets
from automodel.errors import AutomodelError, ConfigIssue
from automodel.suggest import did_you_mean

SUCCESS, FAILED, STOPPED = "success", "failed", "stopped"  # close(status)
UPSTREAM_SECTIONS = ("wandb", "mlflow")  # top-level sections that mean "use this backend with these settings"
_ENABLE_KEYS = ("enable", "enabled")


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


# ---- TensorBoard -----------------------------------------------------------------------------------------------

@dataclass
class TensorBoardSettings:
    log_dir: str | None = field(default=None, metadata={"help": "event file directory (default "
                                                                "<checkpoint_dir>/tensorboard)"})
    flush_secs: int = field(default=30, metadata={"help": "how often pending events are written to disk"})
    log_config: bool = field(default=True, metadata={"help": "write the masked config as a text summary"})


class TensorBoardLogger(MetricLogger):
    """Scalars through ``torch.utils.tensorboard.SummaryWriter``."""

    requires = ("tensorboard",)
    install_hint = "pip install automodel-core[tensorboard]"
    settings_schema = TensorBoardSettings

    def __init__(self, settings: TensorBoardSettings, context: LoggerContext):
        super().__init__(settings, context)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(settings.log_dir) if settings.log_dir else context.checkpoint_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=settings.flush_secs)
        context.log(f"tensorboard: {self.log_dir} (view with: tensorboard --logdir {self.log_dir})")

    def log_config(self, config: dict[str, Any]) -> None:
        if self.settings.log_config:
            from automodel.config import dump_yaml

            text = "\n".join("    " + line for line in dump_yaml(config).splitlines())  # a markdown code block
            self.writer.add_text("config", text)

    def _scalars(self, values: dict[str, float], step: int, walltime: Any) -> None:
        walltime = float(walltime) if isinstance(walltime, (int, float)) else None
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def log_train(self, sample: dict[str, Any], step: int) -> None:
        self._scalars(train_scalars(sample), step, sample.get("timestamp"))

    def log_validation(self, record: dict[str, Any], step: int) -> None:
        self._scalars(validation_scalars(record), step, record.get("timestamp"))

    def close(self, status: str) -> None:
        self.writer.close()  # flushes


# ---- MLflow ----------------------------------------------------------------------------------------------------

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


# ---- Weights & Biases ------------------------------------------------------------------------------------------

@dataclass
class WandbSettings:
    project: str | None = field(default="automodel", metadata={"help": "W&B project"})
    entity: str | None = field(default=None, metadata={"help": "W&B team or user (default: your default entity)"})
    name: str | None = field(default=None, metadata={"help": "the run's display name (default: W&B picks one)"})
    mode: Literal["online", "offline", "disabled"] | None = field(default=None, metadata={
        "help": "online needs credentials (wandb login / WANDB_API_KEY); offline writes a run directory to "
                "`wandb sync` later (default: $WANDB_MODE, else online)"})
    dir: str | None = field(default=None, metadata={"help": "where the wandb/ run directory goes (default "
                                                            "<checkpoint_dir>)", "aliases": ("save_dir",)})
    group: str | None = field(default=None, metadata={"help": "run group"})
    job_type: str | None = field(default=None, metadata={"help": "job type"})
    tags: list[str] | None = field(default=None, metadata={"help": "run tags"})
    notes: str | None = field(default=None, metadata={"help": "run notes"})
    id: str | None = field(default=None, metadata={"help": "run id (with resume, continues that run)"})
    resume: bool | str | None = field(default=None, metadata={"help": "wandb.init's resume: allow, must, never, "
                                                                      "auto"})
    settings: dict = field(default_factory=dict, metadata={"help": "keyword arguments of wandb.Settings"})


class WandbLogger(MetricLogger):
    """A W&B run: the masked config as run config, metrics per step; ``mode: offline`` needs no network."""

    requires = ("wandb",)
    install_hint = "pip install automodel-core[wandb]"
    settings_schema = WandbSettings

    def __init__(self, settings: WandbSettings, context: LoggerContext):
        super().__init__(settings, context)
        import wandb

        directory = Path(settings.dir) if settings.dir else context.checkpoint_dir
        directory.mkdir(parents=True, exist_ok=True)
        init = {k: getattr(settings, k) for k in ("project", "entity", "name", "mode", "group", "job_type", "tags",
                                                   "notes", "id", "resume") if getattr(settings, k) is not None}
        try:
            self.run = wandb.init(dir=str(directory), settings=wandb.Settings(**{"silent": True,
                                                                                **settings.settings}), **init)
        except Exception as err:  # noqa: BLE001 - no credentials, no network, a bad setting: say what to do
            raise AutomodelError(
                f"wandb: the run could not start: {type(err).__name__}: {str(err).rstrip('.')}. For online mode log in "
                "(`wandb login` or WANDB_API_KEY); without network set wandb.mode: offline and `wandb sync` "
                "the run directory later") from err
        files = getattr(self.run, "dir", None)  # <dir>/wandb/<offline-run-...>/files
        where = Path(files).parent if files else directory
        offline = getattr(getattr(self.run, "settings", None), "mode", settings.mode) in ("offline", "dryrun")
        label = f"{self.run.name} ({self.run.id})" if self.run.name else self.run.id
        context.log(f"wandb: run {label} in {where}" + (f" (offline; upload it later with: wandb sync {where})"
                                                        if offline else ""))

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_train(self, sample: dict[str, Any], step: int) -> None:
        self.run.log(train_scalars(sample), step=step)

    def log_validation(self, record: dict[str, Any], step: int) -> None:
        self.run.log(validation_scalars(record), step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == SUCCESS else 1)


# ---- choosing backends from the config (validation and setup) -------------------------------------------------

@dataclass
class BackendSpec:
    name: str
    key: str  # the config key that asked for it
    factory: Callable[..., MetricLogger]
    settings: Any


def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _plain(value: Any) -> Any:
    return value.to_dict() if hasattr(value, "to_dict") and callable(value.to_dict) else value


def resolve_backends(cfg: Any, registry: Any) -> tuple[list[BackendSpec], list[ConfigIssue]]:
    """The backends the config asks for, each with validated settings, and every problem found.

    ``registry`` is the plugin manager's LoggerRegistry. Unknown names, settings that do not fit the backend and
    backends whose package is missing are issues, so that they fail validation before anything is built.
    """
    issues: list[ConfigIssue] = []
    registered = sorted(registry.loggers)
    listing = ", ".join(registered) or "none"
    requested: dict[str, str] = {}  # backend -> config key that asked for it
    settings: dict[str, tuple[str, dict]] = {}  # backend -> (config key, settings mapping)

    section = _plain(cfg.get("logging"))
    if isinstance(section, (list, str)):
        section = {"backends": section}
    if section is None:
        section = {}
    if not isinstance(section, dict):
        issues.append(ConfigIssue("logging", f"expected a section such as {{backends: [tensorboard]}}, found "
                                             f"{section!r}"))
        section = {}
    backends = section.get("backends") or []
    if isinstance(backends, str):
        backends = [backends]
    if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
        issues.append(ConfigIssue("logging.backends", f"expected a list of backend names such as [tensorboard, "
                                                      f"mlflow], found {backends!r}"))
        backends = []
    for i, name in enumerate(backends):
        requested.setdefault(name, f"logging.backends[{i}]")
    for name, value in section.items():
        if name == "backends":
            continue
        key = f"logging.{name}"
        if name not in registry.loggers:
            issues.append(ConfigIssue(key, f"unknown key; 'logging' accepts: backends, and the settings of a "
                                           f"registered backend: {listing}", did_you_mean(str(name),
                                                                                          ["backends", *registered])))
            continue
        if value is None:
            value = {}
        if not isinstance(value, dict):
            issues.append(ConfigIssue(key, f"expected the {name} backend's settings (a mapping), found {value!r}"))
            continue
        settings[name] = (key, value)
        requested.setdefault(name, key)
    for name in UPSTREAM_SECTIONS:
        value = _plain(cfg.get(name))
        if value is None:
            continue
        if not isinstance(value, dict):
            issues.append(ConfigIssue(name, f"expected the {name} backend's settings (a mapping), found {value!r}"))
            continue
        if name in settings:
            issues.append(ConfigIssue(name, f"the {name} backend's settings are given twice, as '{name}' and as "
                                            f"'logging.{name}'; keep one"))
            continue
        settings[name] = (name, value)
        requested.setdefault(name, name)

    specs: list[BackendSpec] = []
    for name, key in requested.items():
        settings_key, values = settings.get(name, (f"logging.{name}", {}))
        values = dict(values)
        enable = True
        for flag in _ENABLE_KEYS:
            if flag in values:
                enable = values.pop(flag)
                if not isinstance(enable, bool):
                    issues.append(ConfigIssue(f"{settings_key}.{flag}", f"expected true or false, found {enable!r}"))
        if enable is not True:
            continue
        if name not in registry.loggers:
            issues.append(ConfigIssue(key, f"unknown logging backend '{name}'; the registered backends are: "
                                           f"{listing}", did_you_mean(name, registered)))
            continue
        try:
            factory = registry.get(name)
        except Exception as err:  # noqa: BLE001 - a plugin's broken backend is a config issue, not a crash
            source = registry.loggers[name][1]
            issues.append(ConfigIssue(key, f"the {name} backend (registered by '{source}') cannot be imported: "
                                           f"{type(err).__name__}: {err}"))
            continue
        missing = [m for m in getattr(factory, "requires", ()) if not module_available(m)]
        if missing:
            hint = getattr(factory, "install_hint", None) or f"pip install {' '.join(missing)}"
            packages = ", ".join(f"'{m}'" for m in missing)
            issues.append(ConfigIssue(key, f"the {name} backend needs the {packages} package, which is not "
                                           f"installed; install it with `{hint}`"))
        schema = getattr(factory, "settings_schema", None)
        parsed = validate_dataclass(schema, values, settings_key, issues) if schema is not None else values
        if not missing and parsed is not None:
            specs.append(BackendSpec(name, key, factory, parsed))
    return specs, issues


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
