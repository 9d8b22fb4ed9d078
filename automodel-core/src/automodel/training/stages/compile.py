"""Slot ``compile``: ``torch.compile`` (``compile.enabled``); the eager model stays reachable for saving."""

from __future__ import annotations

import shutil

import torch

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext


def select(cfg: Config) -> tuple[str, str] | None:
    return ("torch", "compile.enabled") if cfg.compile is not None and cfg.compile.enabled else None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    if select(cfg) is None or (cfg.compile.backend or "inductor") != "inductor" or torch.cuda.is_available():
        return []
    if any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return []
    return [ConfigIssue("compile.backend", "inductor on CPU needs a C++ compiler (gcc/clang) on PATH; install one "
                                           "or use backend: aot_eager")]


def compile_model(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """``torch.compile`` with the configured backend and mode."""
    cfg = ctx.cfg.compile
    compiled = torch.compile(model, backend=cfg.backend or "inductor", mode=cfg.mode, fullgraph=cfg.fullgraph,
                             dynamic=cfg.dynamic)
    return compiled, f"torch.compile backend={cfg.backend or 'inductor'} mode={cfg.mode or 'default'}"
