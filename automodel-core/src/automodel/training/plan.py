"""What validation checks across sections and what ``--dry-run`` prints, from the config alone (nothing is built).

The batch layout (``global_batch_size = batch_size * dp_size * grad_accumulation_steps``, DESIGN §6), the data
loaders' settings, every pipeline slot's checks and the logging backends are checked here, before any model is
built; the same layout is what ``TrainRecipe.setup`` builds with.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from automodel.config import Config, ConfigNode, Target
from automodel.errors import ConfigIssue
from automodel.optim import lr_scheduler_issues
from automodel.training.context import BatchLayout
from automodel.training.dist import expected_world_size
from automodel.training.logging.select import resolve_backends
from automodel.training.parallelism import mesh_layout
from automodel.training.parallelism import plan_lines as parallel_plan_lines
from automodel.training.pipeline import pipeline_issues

if TYPE_CHECKING:
    from automodel.plugins.manager import PluginManager
    from automodel.training.recipe import TrainRecipe

LOADERS = ("dataloader", "validation_dataloader")


def batch_layout(cfg: Config) -> tuple[BatchLayout, list[ConfigIssue]]:
    """The micro batch size, data-parallel size and accumulation steps, and the arithmetic problems found."""
    issues: list[ConfigIssue] = []
    steps = cfg.step_scheduler
    loader = cfg.dataloader
    batch_size = loader.get("batch_size") if loader is not None else None
    local = steps.local_batch_size if steps else None
    if batch_size is not None and local is not None and batch_size != local:
        issues.append(ConfigIssue("step_scheduler.local_batch_size",
                                  f"{local} disagrees with dataloader.batch_size={batch_size}; set one of them"))
    batch_size = batch_size or local or 1
    dp = mesh_layout(cfg, expected_world_size())[0].dp
    if steps is None:
        return BatchLayout(batch_size, dp, 1), issues
    accumulation, global_size = steps.grad_accumulation_steps, steps.global_batch_size
    if global_size is not None:
        if accumulation is not None and global_size != batch_size * dp * accumulation:
            issues.append(ConfigIssue(
                "step_scheduler.global_batch_size",
                f"{global_size} != batch_size ({batch_size}) * dp_size ({dp}) * grad_accumulation_steps "
                f"({accumulation}) = {batch_size * dp * accumulation}; fix one of the three"))
        elif accumulation is None:
            if global_size % (batch_size * dp):
                issues.append(ConfigIssue(
                    "step_scheduler.global_batch_size",
                    f"{global_size} is not divisible by batch_size ({batch_size}) * dp_size ({dp}) = "
                    f"{batch_size * dp}, so grad_accumulation_steps cannot be derived"))
            accumulation = max(1, global_size // (batch_size * dp))
    return BatchLayout(batch_size, dp, accumulation or 1), issues


def loader_issues(cfg: Config) -> list[ConfigIssue]:
    """A data loader's batch size must be a positive integer (a dotted ``collate_fn`` is checked by the schema, like
    every ``*_fn`` string)."""
    issues = []
    for name in LOADERS:
        loader = cfg.get(name)
        if not isinstance(loader, ConfigNode):
            continue
        size = loader.get("batch_size")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            issues.append(ConfigIssue(f"{name}.batch_size", f"must be a positive integer, found {size!r}"))
    return issues


def engine_issues(recipe: type[TrainRecipe], cfg: Config, plugins: PluginManager) -> list[ConfigIssue]:
    """Everything the engine checks across sections before building."""
    issues = batch_layout(cfg)[1] + loader_issues(cfg)
    steps = cfg.step_scheduler
    issues += lr_scheduler_issues(cfg.get("lr_scheduler"), steps.max_steps if steps is not None else None)
    issues += pipeline_issues(cfg, plugins.stages, recipe.merged("stage_implementations"),
                              recipe.merged("unsupported_stages"))
    issues += resolve_backends(cfg, plugins.loggers)[1]
    if cfg.dist_env is not None:
        issues += [ConfigIssue(f"dist_env.{key}", message)
                   for key, message in cfg.dist_env.rendezvous_issues(os.environ).items()]
    return issues


def _target(recipe: type[TrainRecipe], cfg: Config, name: str) -> Any:
    """What a target section calls: its ``_target_``, else its spec's default (the default node's or target)."""
    node, spec = cfg.get(name), recipe.all_sections().get(name)
    if isinstance(node, ConfigNode) and node.target:
        return node.target
    if isinstance(spec, Target) and isinstance(node, ConfigNode) and spec.default_target:
        return spec.default_target
    return None


def plan_lines(recipe: type[TrainRecipe], cfg: Config, plugins: PluginManager) -> list[str]:
    """The ``--dry-run`` plan: what would be built, the batch layout, the pipeline and where checkpoints go."""
    layout, _ = batch_layout(cfg)
    steps = cfg.step_scheduler
    dataset = _target(recipe, cfg, "dataset") if cfg.dataset is not None else "built by the recipe"
    lines = [f"recipe: {recipe.__module__}.{recipe.__qualname__}", f"model: {cfg.model.target}",
             f"dataset: {dataset}"]
    lines += [f"{name}: {_target(recipe, cfg, name)}" for name in cfg.section_names()
              if name.startswith("validation_dataset") and isinstance(cfg.get(name), ConfigNode)]
    optimizer = recipe.all_sections()["optimizer"].default
    lines += [f"batch: {layout.micro_batch_size} per micro-batch x {layout.dp_size} ranks x "
              f"{layout.grad_accumulation_steps} accumulation = {layout.samples_per_step} samples per step",
              f"steps: max_steps={steps.max_steps} num_epochs={steps.num_epochs} "
              f"val every {steps.val_check_interval} ckpt every {steps.checkpoint_interval}",
              f"optimizer: {cfg.optimizer.target if cfg.optimizer else optimizer['_target_'] + ' (default)'}"]
    selection = recipe.pipeline_selection(cfg)
    lines += parallel_plan_lines(cfg, selection.get("sharding", (None, ""))[0])
    lines += [f"pipeline {slot}: {name}" for slot, (name, _) in selection.items()]
    if cfg.distributed is not None and cfg.distributed.activation_checkpointing:
        lines.append("activation checkpointing: every transformer block (before sharding)")
    ckpt = cfg.checkpoint
    lines.append(f"checkpoints: {ckpt.checkpoint_dir}" if ckpt.enabled else "checkpoints: disabled")
    backends = [spec.name for spec in resolve_backends(cfg, plugins.loggers)[0]]
    if backends:
        lines.append(f"logging: {', '.join(backends)}")
    return lines
