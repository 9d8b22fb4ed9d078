"""Learning-rate schedules, as plain ``LRScheduler`` subclasses (their state is plain numbers, so checkpoints resume
them): warmup-then-decay classes named by ``_target_``, and the upstream schedule of a plain ``lr_scheduler:``; and
the optimizers of upstream configs that torch does not have (``Muon``, upstream's ``dion.Muon``)."""

from automodel.optim.muon import Muon
from automodel.optim.param_scheduler import (
    LR_DECAY_STYLES,
    OptimizerParamScheduler,
    build_scheduler,
    lr_scheduler_issues,
)
from automodel.optim.warmup import ConstantWarmup, CosineAnnealingWarmup, LinearWarmup

__all__ = ["LR_DECAY_STYLES", "ConstantWarmup", "CosineAnnealingWarmup", "LinearWarmup", "Muon",
           "OptimizerParamScheduler", "build_scheduler", "lr_scheduler_issues"]
