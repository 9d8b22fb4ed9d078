"""LoRA on the language model (pipeline slot ``peft``, implementation ``vlm_lora``), through peft.

The ``peft:`` section is the core's (``automodel.hf.PeftConfig``: dim, alpha, dropout, target_modules |
match_all_linear); here its targets are limited to the language model's linear layers, so the vision tower and
projector get no adapters. A ``peft._target_: peft.LoraConfig`` is used exactly as given.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel.hf import PeftConfig, apply_lora, lora_config
from automodel.lora_targets import all_linear_targets
from automodel.training.context import BuildContext
from automodel_vlm.parts import base_model, find_part, whole_model


def _linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Conv1D", "Linear8bitLt", "Linear4bit")


def language_model_targets(model: torch.nn.Module, patterns: Any) -> list[str]:
    """Full names of the language model's linear layers (output head excluded) that match ``patterns``
    (``all-linear``, or module names / globs matched against the name, its last component, and the name a causal
    LM gives the layer: ``model.layers.3.self_attn.q_proj``, as upstream's own VLM classes such as Muse Glimmer's
    name their decoder, where transformers' is ``model.language_model.layers.3...``)."""
    located = find_part(model, "language_model")
    if located is None:
        raise AutomodelError(f"peft: {type(base_model(model)).__name__} has no language model module "
                             "(language_model / text_model); name the modules with peft._target_: peft.LoraConfig")
    prefix, language = located
    head = base_model(model).get_output_embeddings()
    globs = [patterns] if isinstance(patterns, str) else list(patterns)
    names = []
    for name, module in language.named_modules():
        if not name or not _linear(module) or module is head:
            continue
        full, as_causal_lm = f"{prefix}.{name}", f"model.{name}"
        if patterns == "all-linear" or any(
                fnmatch.fnmatch(full, p) or fnmatch.fnmatch(name.rsplit(".", 1)[-1], p) or full.endswith("." + p)
                or fnmatch.fnmatch(as_causal_lm, p) for p in globs):
            names.append(full)
    if not names:
        raise AutomodelError(f"peft.target_modules: {patterns} matches no linear layer of the language model "
                             f"'{prefix}'")
    return names


def apply_lora_to_language_model(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    built = ctx.instantiate("peft")
    config = lora_config(built)
    whole = whole_model(model)
    if not isinstance(built, PeftConfig):  # a peft.LoraConfig, used as given (all-linear: the whole model's layers)
        if whole is None:
            return apply_lora(model, config, f" on {config.target_modules}")
        config = all_linear_targets(config, whole)
        targets = config.target_modules
        named = targets if isinstance(targets, str) else f"{len(targets)} modules of the whole model"
        return apply_lora(model, config, f" on {named} (pipeline stage {base_model(model).index})", plain=True)
    patterns = "all-linear" if built.match_all_linear else built.target_modules  # upstream's names and globs
    # a pipeline stage: the targets are the whole model's (every stage's adapter_config.json names them all), the
    # stage adapts those it holds, wrapped in peft's plain PeftModel (its forward passes the stage's arguments on)
    config.target_modules = language_model_targets(whole if whole is not None else model, patterns)
    where = f" on {len(config.target_modules)} language-model layers"
    if whole is not None:
        config.base_model_name_or_path = getattr(whole, "name_or_path", None) or None
        where += f" (pipeline stage {base_model(model).index})"
    return apply_lora(model, config, where, memory_efficient=built.memory_efficient, plain=whole is not None)
