"""Slot ``freeze``: parameters matching ``freeze.patterns`` (and the embeddings) stop training."""

from __future__ import annotations

import fnmatch

import torch

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.parallel.pipeline_stages import PipelineStageModel


def select(cfg: Config) -> tuple[str, str] | None:
    """Acts when the config has a ``freeze:`` section, or when the section's defaults freeze something."""
    acts = "freeze" in cfg or (cfg.freeze is not None and cfg.freeze.freezes_anything())
    return ("patterns", "freeze") if acts else None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    return []


def unfrozen(name: str, patterns: list[str]) -> bool:
    """Whether ``freeze.unfreeze_modules`` keeps the parameter ``name`` trainable."""
    return any(fnmatch.fnmatch(name, p) or name.startswith(p + ".") for p in patterns)


def freeze_parameters(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """Freeze parameters matching ``freeze.patterns`` (and embeddings: on a pipeline stage, the first stage's),
    except ``freeze.unfreeze_modules``."""
    cfg = ctx.cfg.freeze
    patterns = list(cfg.patterns)
    if cfg.embeddings and (isinstance(model, PipelineStageModel) or hasattr(model, "get_input_embeddings")):
        embeddings = model.input_embedding if isinstance(model, PipelineStageModel) else model.get_input_embeddings()
        patterns += sorted(f"{name}.weight" for name, module in model.named_modules() if module is embeddings)
    frozen = 0
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatch(name, p) for p in patterns) and not unfrozen(name, cfg.unfreeze_modules):
            param.requires_grad_(False)
            frozen += 1
    total = sum(1 for _ in model.parameters())
    return model, f"froze {frozen} of {total} parameter tensors"
