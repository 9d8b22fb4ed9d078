"""LoRA on the denoiser (pipeline slot ``peft``, implementation ``diffusion_lora``), through peft as diffusers does.

The ``peft:`` section is the core's (``automodel.hf.PeftConfig``: dim, alpha, dropout, target_modules |
match_all_linear, exclude_modules; ``target_modules`` are module names or upstream's globs such as ``*.to_q``,
matched against the denoiser's module names as for the LLM). A ``peft._target_: peft.LoraConfig`` is used as given.
The adapters go on the denoiser (transformer or UNet) with diffusers' ``add_adapter``; its base weights freeze.

A checkpoint's ``model/`` then holds only the adapter, as an LLM LoRA checkpoint does, in the file diffusers'
``<Pipeline>.save_lora_weights`` writes (``pytorch_lora_weights.safetensors``, peft's LoRA config in its
metadata): ``<Pipeline>.from_pretrained(base).load_lora_weights(model_dir)`` loads it. A pipeline without LoRA
loaders (HunyuanVideo15Pipeline) gets the same file, which its denoiser loads:
``pipeline.transformer.load_lora_adapter(model_dir, prefix="transformer", weight_name=LORA_WEIGHTS)``. The base is
not rewritten.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from automodel.errors import AutomodelError, ConfigError, ConfigIssue
from automodel.hf import lora_config, memory_efficient
from automodel.training.checkpoint import CheckpointError
from automodel.training.context import BuildContext
from automodel.training.modules import unwrap

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' save_lora_weights / load_lora_weights file
ADAPTER = "default"  # the adapter's name (peft's default, the one diffusers' add_adapter gives)


def peft_issues(cfg: Any, trainable: list[str] | None, denoiser: str) -> list[ConfigIssue]:
    """What a ``peft:`` section asks that LoRA on the denoiser cannot do (validation)."""
    peft = cfg.get("peft")
    if peft is None:
        return []
    issues = []
    if trainable and list(trainable) != [denoiser]:
        issues.append(ConfigIssue("model.trainable_components", f"{trainable} with peft: LoRA adapts the denoiser "
                                  f"('{denoiser}') only, its base weights frozen; leave trainable_components unset "
                                  "or remove peft: to train these components whole"))
    if peft.get("use_dora"):
        issues.append(ConfigIssue("peft.use_dora", "true is not supported by diffusion LoRA: the adapter is saved "
                                  "in diffusers' plain LoRA format; remove it"))
    return issues


def has_lora(model: torch.nn.Module) -> bool:
    """Whether the pipeline module's denoiser carries LoRA adapters."""
    model = unwrap(model)
    return bool(getattr(unwrap(model.components[model.denoiser_name]), "peft_config", None))


def denoiser_lora_config(built: Any, denoiser: torch.nn.Module) -> Any:
    """peft's ``LoraConfig`` for the denoiser: globs resolved to its linear layers, ``match_all_linear`` spelt out
    as every linear layer (peft's ``all-linear`` is for transformers models only), no task type."""
    try:
        config = copy.copy(lora_config(built, denoiser))
    except AutomodelError as err:
        raise ConfigError(ConfigIssue("peft.target_modules", str(err).removeprefix("peft.target_modules: "))) \
            from None
    config.task_type = None
    targets = config.target_modules
    if isinstance(targets, str) and targets.lower() == "all-linear":
        config.target_modules = [name for name, module in denoiser.named_modules()
                                 if isinstance(module, torch.nn.Linear)]
    return config


def add_denoiser_lora(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """Put LoRA adapters on the denoiser of the ``AutoDiffusionPipeline`` as ``peft:`` says; only they train."""
    built = ctx.instantiate("peft")
    name = model.denoiser_name
    denoiser = model.components[name]
    config = denoiser_lora_config(built, denoiser)
    denoiser.requires_grad_(False)
    try:
        denoiser.add_adapter(config, adapter_name=ADAPTER)
    except ValueError as err:
        raise ConfigError(ConfigIssue("peft.target_modules", f"{err}")) from None
    line = ""
    if memory_efficient(built):
        from automodel.lora_memory import recompute_lora_branches

        line = f"; {recompute_lora_branches(denoiser)} adapters recompute their rank-r activation in backward"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    adapted = len({n.split(".lora_")[0] for n, _ in denoiser.named_parameters() if ".lora_" in n})
    return model, (f"LoRA r={config.r} alpha={config.lora_alpha} on {adapted} layers of the {name}: {trainable} of "
                   f"{total} parameters train{line}")


def save_lora(model: torch.nn.Module, directory: Path, state_dict: dict[str, torch.Tensor] | None) -> None:
    """The denoiser's adapter in diffusers' LoRA format (``state_dict``: the whole weights gathered, or None)."""
    from peft import get_peft_model_state_dict

    model = unwrap(model)
    name = model.denoiser_name
    denoiser = unwrap(model.components[name])
    prefix = f"components.{name}."
    own = None if state_dict is None else \
        {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
    layers = {k: v.detach().contiguous() for k, v in
              get_peft_model_state_dict(denoiser, state_dict=own, adapter_name=ADAPTER).items()}
    metadata = denoiser.peft_config[ADAPTER].to_dict()
    pipeline_cls = type(model.pipeline)
    if hasattr(pipeline_cls, "save_lora_weights"):
        pipeline_cls.save_lora_weights(str(directory), **{f"{name}_lora_layers": layers,
                                                          f"{name}_lora_adapter_metadata": metadata},
                                       safe_serialization=True)
        return
    from diffusers.loaders.lora_base import LoraBaseMixin

    # what save_lora_weights writes: the layers and the config, each under the denoiser's name
    LoraBaseMixin._save_lora_weights(str(directory), lora_layers={name: layers}, lora_metadata={name: metadata},
                                     safe_serialization=True)


def load_lora(model: torch.nn.Module, directory: Path) -> None:
    """A saved adapter (``save_lora``) back into the denoiser's adapters (resume)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    model = unwrap(model)
    name = model.denoiser_name
    file = directory / LORA_WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"restore_from.path: '{directory}' has no {LORA_WEIGHTS}: it is not a LoRA checkpoint "
                              "(resume it without the peft: section, or with the run that wrote it)")
    denoiser = unwrap(model.components[name])
    saved = {k.removeprefix(f"{name}."): v for k, v in load_file(str(file)).items() if k.startswith(f"{name}.")}
    result = set_peft_model_state_dict(denoiser, saved, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing or not saved:
        raise CheckpointError(f"restore_from.path: the adapter in '{file}' does not fit this {name}'s LoRA "
                              f"(unexpected: {list(result.unexpected_keys)[:3]}, missing: {missing[:3]}); resume "
                              "with the same peft: settings as the run that wrote it")

