"""The core's own registrations, made through the same hooks a third-party plugin uses."""

from __future__ import annotations

from automodel.plugins.markers import hookimpl

_TRAINING = "automodel.training"
_STAGES = "automodel.training.stages"


@hookimpl
def automodel_register_commands(cli) -> None:
    from automodel.cli.commands import CORE_COMMANDS

    for command in CORE_COMMANDS:
        cli.add_command(command)
        cli.core_commands.add(command.name)


@hookimpl
def automodel_register_builders(builders) -> None:
    for name in ("model", "optimizer", "dataloader", "loss_fn", "lr_scheduler", "step_scheduler",
                 "checkpoint_config"):
        builders.add(name, f"{_TRAINING}.builders.build_{name}")


@hookimpl
def automodel_register_stages(stages) -> None:
    stages.add("peft", "lora", f"{_STAGES}.peft.add_lora")
    stages.add("checkpoint", "restore", f"{_STAGES}.checkpoint.restore_checkpoint")
    stages.add("freeze", "patterns", f"{_STAGES}.freeze.freeze_parameters")
    stages.add("device", "single", f"{_STAGES}.device.place_on_device")
    stages.add("fp8", "torchao", f"{_STAGES}.fp8.float8_training")
    stages.add("qat", "torchao", f"{_STAGES}.qat.fake_quantize")
    stages.add("compile", "torch", f"{_STAGES}.compile.compile_model")
    stages.add("sharding", "ddp", f"{_STAGES}.sharding.wrap_ddp")
    stages.add("sharding", "fsdp2", f"{_STAGES}.sharding.wrap_fsdp2")
    stages.add("sharding", "megatron_fsdp", f"{_STAGES}.sharding.wrap_megatron_fsdp")
    stages.add("context_parallel", "cp_attention", f"{_STAGES}.context_parallel.attention")


@hookimpl
def automodel_register_aliases(aliases) -> None:
    aliases.target("MaskedCrossEntropy", "automodel.training.loss.MaskedCrossEntropy")
    aliases.target("ChunkedCrossEntropy", "automodel.training.loss.ChunkedCrossEntropy")
    aliases.target("FusedLinearCrossEntropy", "automodel.training.linear_ce.LinearCrossEntropy")
    aliases.target("nemo_automodel.components.loss.kd_loss.KDLoss", "automodel.training.distillation.loss.KDLoss")
    aliases.unsupported("nemo_automodel.components.models.common.utils.TEFp8Config",
                        "Transformer Engine's FP8 recipe (model.backend.te_fp8) needs a CUDA GPU with compute "
                        "capability >= 8.9 and Transformer Engine; automodel's FP8 is the fp8: section (torchao)")
    for name in ("FlashAdamW", "FlashAdam", "FlashSGD", "FlashSGDW", "FlashLion"):
        aliases.unsupported(f"flashoptim.{name}", "FlashOptim's optimizers run fused Triton kernels on CUDA GPUs "
                                                  "(their reduced-precision master weights and states); use the torch "
                                                  "optimizer of the same update (torch.optim.AdamW for FlashAdamW)")
    for path in ("transformer_engine.pytorch.optimizers.FusedAdam",
                 "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"):
        aliases.unsupported(path, "Transformer Engine's fused Adam needs a CUDA GPU and Transformer Engine; use "
                                  "torch.optim.AdamW (the same update; fused: true on a GPU)")
    aliases.target("dion.Muon", "automodel.optim.Muon")  # upstream's Muon (Microsoft's dion package)
    aliases.target("CosineAnnealingWarmup", "automodel.optim.CosineAnnealingWarmup")
    aliases.target("LinearWarmup", "automodel.optim.LinearWarmup")
    aliases.target("ConstantWarmup", "automodel.optim.ConstantWarmup")
    aliases.target("StatefulDataLoader", "torchdata.stateful_dataloader.StatefulDataLoader")
    # upstream's model.backend, which every model domain's factories accept
    aliases.target("BackendConfig", "automodel.model_backend.BackendConfig")
    for path in ("nemo_automodel.components.models.common.BackendConfig",
                 "nemo_automodel.components.models.common.utils.BackendConfig"):
        aliases.target(path, "automodel.model_backend.BackendConfig")


@hookimpl
def automodel_allowed_targets() -> list[str]:
    from automodel.config.core_targets import CORE_TARGETS

    return list(CORE_TARGETS)


@hookimpl
def automodel_register_loggers(loggers) -> None:
    loggers.add("tensorboard", f"{_TRAINING}.logging.tensorboard.TensorBoardLogger")
    loggers.add("mlflow", f"{_TRAINING}.logging.mlflow.MLflowLogger")
    loggers.add("wandb", f"{_TRAINING}.logging.wandb.WandbLogger")
