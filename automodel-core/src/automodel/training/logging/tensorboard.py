"""TensorBoard: scalars through ``torch.utils.tensorboard.SummaryWriter`` (automodel-core[tensorboard])."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from automodel.training.logging.base import LoggerContext, MetricLogger, train_scalars, validation_scalars


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
