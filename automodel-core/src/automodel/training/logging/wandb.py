"""Weights & Biases: the masked config as run config and metrics per step (``pip install automodel-core[wandb]``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from automodel.errors import AutomodelError
from automodel.training.logging.base import SUCCESS, LoggerContext, MetricLogger, train_scalars, validation_scalars


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
