"""LoRA on the language model (pipeline slot ``peft``, implementation ``vlm_lora``), through peft.

The ``peft:`` section is the LLM domain's (``automodel_llm.peft.PeftConfig``: dim, alpha, dropout,
target_modules | match_all_linear); here its targets are limited to the language model's linear layers, so the
vision tower and projector get no adapters. A ``peft._target_: peft.LoraConfig`` is used exactly as given.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any

import torch

from automodel.errors import AutomodelError
from automodel_vlm.parts import base_model, find_part

if TYPE_CHECKING:
    from automodel.training.recipe import TrainRecipe


def _linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Conv1D", "Linear8bitLt", "Linear4bit")


def language_model_targets(model: torch.nn.Module, patterns: Any) -> list[str]:
    """Full names of the language model's linear layers (output head excluded) that match ``patterns``
    (``all-linear``, or module names / globs matched against the name and its last component)."""
    located = find_part(model, "language_model")
    if located is None:
        raise AutomodelError(f"peft: {type(base_model(model)).__name__} has no language model module "
                             "(language_model / text_model); name the modules with peft._target_: peft.LoraConfig")
    prefix, language = located
    head = base_model(model).get_output_embeddings()
    names = []
    for name, module in language.named_modules():
        if not name or not _linear(module) or module is head:
            continue
        full = f"{prefix}.{name}"
        if patterns == "all-linear" or any(
                fnmatch.fnmatch(full, p) or fnmatch.fnmatch(name.rsplit(".", 1)[-1], p) or full.endswith("." + p)
                for p in ([patterns] if isinstance(patterns, str) else list(patterns))):
            names.append(full)
    if not names:
        raise AutomodelError(f"peft.target_modules: {patterns} matches no linear layer of the language model "
                             f"'{prefix}'")
    return names


def apply_lora_to_language_model(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    import peft

    from automodel_llm.peft import PeftConfig, lora_config_from

    built = recipe.cfg.peft.instantiate(default_target="automodel_llm.peft.PeftConfig")
    if isinstance(built, PeftConfig):
        config = built.to_lora_config()
        config.target_modules = language_model_targets(model, config.target_modules)
    else:
        config = lora_config_from(recipe)  # a peft.LoraConfig, used as given
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as err:
        raise AutomodelError(f"peft.target_modules: {err}") from None
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    where = f"{len(config.target_modules)} language-model layers" if isinstance(built, PeftConfig) else \
        f"{config.target_modules}"
    return wrapped, f"LoRA r={config.r} alpha={config.lora_alpha} on {where}: {trainable} of {total} parameters train"
