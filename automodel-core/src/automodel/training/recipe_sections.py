"""The sections every training recipe takes (``TrainRecipe.sections``): the keyed ones are dataclasses in
``sections.py``; the others name what builds them (``Target``), are free-form (``Free``) or stand for another key
(``KeyAlias``). A domain's recipe adds or replaces sections in its own ``sections``."""

from __future__ import annotations

from typing import Any

from automodel.config import Config, ConfigNode, Free, KeyAlias, Metadata, Target
from automodel.training import builders
from automodel.training import sections as s
from automodel.training.distributed_section import DistributedConfig
from automodel.training.prewarm_section import PrewarmConfig
from automodel.training.qat_section import QATConfig

_DATALOADER = Target("data loading (a StatefulDataLoader's keyword arguments)", runtime_args=("dataset",),
                     plain=True, default_target="torchdata.stateful_dataloader.StatefulDataLoader", default={},
                     builder_args=builders.LOADER_BUILDER_ARGS)

TRAIN_SECTIONS: dict[str, Any] = {
    "step_scheduler": s.StepSchedulerConfig,
    "dist_env": s.DistEnvConfig,
    "rng": s.RngConfig,
    "seed": KeyAlias("rng.seed", "the run's seed, upstream's top-level key: the same as rng.seed, and ranked "
                     "(seed + rank per process) unless rng.ranked says otherwise; given with a different "
                     "rng.seed it wins, as upstream's recipes read only this key (the global RNGs, the model's "
                     "initialisation and the data order)", implies={"ranked": True}, wins=True),
    "checkpoint.restore_from": KeyAlias("restore_from.path", "upstream's spelling of restore_from.path: a "
                                        "checkpoint path, a directory name under checkpoint_dir, or LATEST"),
    "model": Target("the model to train: {_target_: ..., ...}", required=True),
    "compile": s.CompileConfig,
    "clip_grad_norm": s.ClipGradConfig,
    "distributed": DistributedConfig,
    "loss_fn": Target("the loss (the engine sums it over label tokens: reduction is set to sum); next-token "
                      "recipes also take ChunkedCrossEntropy {chunk_len} (fp32 a chunk of logits at a time) and "
                      "FusedLinearCrossEntropy {chunk_len, logit_softcapping} (the loss inside the output head, no "
                      "logits materialised)",
                      default={"_target_": "automodel.training.loss.MaskedCrossEntropy"}),
    "dataset": Target("the training data set", required=True),
    "validation_dataset": Target("a validation data set"),
    "validation_dataset_*": Target("more validation data sets, reported by name"),
    "dataloader": _DATALOADER,
    "validation_dataloader": _DATALOADER,
    "optimizer": Target("the optimizer (the recipe gives `model` only to one whose signature names it: Muon)",
                        runtime_args=("params", "model"),
                        default={"_target_": "torch.optim.AdamW", "lr": 1e-5}),
    "lr_scheduler": Target("learning-rate schedule: {_target_: ...} or upstream keys (lr_decay_style, ...; "
                           "null ones default as upstream's, see docs/targets.md#learning-rate-schedules)",
                           runtime_args=("optimizer",), plain=True,
                           default_target="automodel.optim.build_scheduler"),
    "fault_tolerance": s.FaultToleranceConfig,
    "slurm": s.SlurmConfig,
    "logging": Free("metric logging backends: {backends: [tensorboard, mlflow, wandb], <backend>: {settings}}; "
                    "see docs/logging.md (checked by validation against the registered backends)"),
    "wandb": Free("upstream-style Weights & Biases settings {project, entity, name, save_dir, mode, ...}: the "
                  "same as logging.wandb (enable: false turns it off)"),
    "mlflow": Free("upstream-style MLflow settings {experiment_name, run_name, tracking_uri, tags, ...}: the "
                   "same as logging.mlflow (enable: false turns it off)"),
    "checkpoint": s.CheckpointConfig,
    "restore_from": s.RestoreConfig,
    "peft": Target("LoRA adapters through peft: {dim, alpha, dropout, target_modules | match_all_linear} (or "
                   "_target_: peft.LoraConfig, used as given)", plain=True,
                   default_target="automodel.hf.PeftConfig"),
    "fp8": s.FP8Config,
    "qat": QATConfig,
    "freeze": s.FreezeConfig,
    "prewarm": PrewarmConfig,
    "distributed_config": Metadata("upstream's FSDP2Config section in some of its examples, which its recipes "
                                   "never read (the strategy comes from distributed:, as here)"),
}


def data_sections(cfg: Config) -> dict[str, ConfigNode]:
    """The data set sections ``cfg`` gives: ``dataset`` and each ``validation_dataset*``, by name."""
    return {name: cfg.get(name) for name in cfg.section_names() if cfg.get(name) is not None
            and (name in ("dataset", "validation_dataset") or name.startswith("validation_dataset_"))}
