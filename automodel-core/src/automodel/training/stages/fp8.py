"""Slot ``fp8``: float8 training through torchao (``fp8.enabled``); refused at validation without a capable GPU."""

from __future__ import annotations

import importlib.util

import torch

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext


def select(cfg: Config) -> tuple[str, str] | None:
    return ("torchao", "fp8.enabled") if cfg.fp8 is not None and cfg.fp8.enabled else None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    if select(cfg) is None:
        return []
    cuda = torch.cuda.is_available()
    capable = cuda and torch.cuda.get_device_capability() >= (8, 9)
    torchao = importlib.util.find_spec("torchao") is not None
    if capable and torchao:
        if cfg.fp8.precompute_float8_dynamic_scale_for_fsdp:
            return [ConfigIssue("fp8.precompute_float8_dynamic_scale_for_fsdp", "true is not implemented here (one "
                                "precomputation of the all-gather scales after each optimizer step); each layer "
                                "computes the same scales itself: set it false")]
        return []
    need = [what for what, ok in (("a CUDA GPU with compute capability >= 8.9 (H100, L40S, RTX 4090)", capable),
                                  ("torchao (pip install torchao)", torchao)) if not ok]
    return [ConfigIssue("fp8.enabled", f"FP8 training needs {' and '.join(need)}; this machine has "
                                       f"{'no GPU' if not cuda else torch.cuda.get_device_name()}")]


def float8_training(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """torchao float8 linear layers (validated beforehand: CUDA with compute capability >= 8.9 and torchao)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fp8 = ctx.cfg.fp8
    name = fp8.recipe_name
    if name and name != "tensorwise":
        config = Float8LinearConfig.from_recipe_name(name)
    else:  # upstream's tensorwise settings
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8.enable_fsdp_float8_all_gather,
                                    force_recompute_fp8_weight_in_bwd=fp8.force_recompute_fp8_weight_in_bwd,
                                    emulate=fp8.emulate)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, fqn: converts_to_float8(module, fqn, fp8.filter_fqns))
    return model, f"float8 training ({name or 'tensorwise'})"


def converts_to_float8(module: torch.nn.Module, fqn: str, filter_fqns: list[str]) -> bool:
    """Whether a layer trains in float8: a linear layer not named in ``fp8.filter_fqns`` whose dimensions are
    multiples of 16 (what float8 matmuls need), upstream's rule."""
    if any(part in fqn for part in filter_fqns) or not isinstance(module, torch.nn.Linear):
        return False
    return all(size % 16 == 0 for size in module.weight.shape)
