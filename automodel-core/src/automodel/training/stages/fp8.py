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
        return []
    need = [what for what, ok in (("a CUDA GPU with compute capability >= 8.9 (H100, L40S, RTX 4090)", capable),
                                  ("torchao (pip install torchao)", torchao)) if not ok]
    return [ConfigIssue("fp8.enabled", f"FP8 training needs {' and '.join(need)}; this machine has "
                                       f"{'no GPU' if not cuda else torch.cuda.get_device_name()}")]


def float8_training(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """torchao float8 linear layers (validated beforehand: CUDA with compute capability >= 8.9 and torchao)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    name = ctx.cfg.fp8.recipe_name
    config = Float8LinearConfig.from_recipe_name(name) if name else Float8LinearConfig()
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: "lm_head" not in fqn)
    return model, f"float8 training ({name or 'tensorwise'})"
