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
from automodel.model_backend import backend_setting
from automodel.optim import lr_scheduler_issues
from automodel.training.context import BatchLayout
from automodel.training.dist import expected_world_size
from automodel.training.logging.select import UPSTREAM_SECTIONS, resolve_backends
from automodel.training.parallelism import mesh_layout
from automodel.training.parallelism import plan_lines as parallel_plan_lines
from automodel.training.pipeline import pipeline_issues
from automodel.v4_config import v4_config_issue

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
    # a distributed section that failed validation (reported under its keys) leaves dp unknown: nothing to check
    unknown_dp = cfg.distributed is None and cfg.resolved.get("distributed") is not None
    if steps is None or unknown_dp:
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


def has_validation_data(cfg: Config) -> bool:
    return any(cfg.get(name) is not None for name in cfg.section_names()
               if name == "validation_dataset" or name.startswith("validation_dataset_"))


def step_scheduler_issues(cfg: Config, backends: list[Any]) -> list[ConfigIssue]:
    """Step-schedule keys that act only together with another section."""
    steps, issues = cfg.step_scheduler, []
    if steps is None:
        return issues
    if steps.val_at_start and not has_validation_data(cfg):
        issues.append(ConfigIssue("step_scheduler.val_at_start", "true, but there is no validation_dataset to "
                                  "validate on; add one or remove the key"))
    # A backend section that is only turned off (wandb: {enable: false}) keeps the key: it acts once the backend is
    # turned on, like the section's own settings; the run says it governs nothing meanwhile.
    configured = any(cfg.get(name) is not None for name in ("logging", *UPSTREAM_SECTIONS))
    if steps.log_remote_every_steps is not None and not backends and not configured:
        issues.append(ConfigIssue("step_scheduler.log_remote_every_steps", "sets how often the metric backends "
                                  "receive the training metrics, but none is configured (logging.backends, wandb:, "
                                  "mlflow:); add one or remove the key (log_interval governs training.jsonl)"))
    return issues


def checkpoint_issues(recipe: type[TrainRecipe], cfg: Config) -> list[ConfigIssue]:
    """``checkpoint.diffusers_compatible`` is what the recipe's model/ is, or it is refused; ``v4_compatible`` has
    the pretrained model's config files to copy into a Hugging Face model/ (:mod:`automodel.v4_config`)."""
    if cfg.checkpoint is None:
        return []
    issues = []
    if cfg.checkpoint.v4_compatible:
        why = (f"{recipe.__name__} writes model/ in a layout of its own; remove it" if recipe.save_model is not None
               else v4_config_issue(cfg.model, adapter=cfg.peft is not None))
        issues += [ConfigIssue("checkpoint.v4_compatible", f"true: {why}")] if why else []
    wanted = cfg.checkpoint.diffusers_compatible
    if wanted is None or wanted == recipe.writes_diffusers_pipeline:
        return issues
    if wanted:
        why = f"{recipe.__name__} writes model/ as a Hugging Face model directory, not a diffusers pipeline"
    else:
        why = f"{recipe.__name__} always writes model/ as a diffusers pipeline (diffusers' from_pretrained loads it)"
    return [*issues, ConfigIssue("checkpoint.diffusers_compatible",
                                 f"{str(wanted).lower()}, but {why}; remove the key")]


def engine_issues(recipe: type[TrainRecipe], cfg: Config, plugins: PluginManager) -> list[ConfigIssue]:
    """Everything the engine checks across sections before building."""
    issues = batch_layout(cfg)[1] + loader_issues(cfg)
    steps = cfg.step_scheduler
    issues += lr_scheduler_issues(cfg.get("lr_scheduler"), steps.max_steps if steps is not None else None)
    issues += pipeline_issues(cfg, plugins.stages, recipe.merged("stage_implementations"),
                              recipe.merged("unsupported_stages"))
    backends, backend_issues = resolve_backends(cfg, plugins.loggers)
    issues += backend_issues + step_scheduler_issues(cfg, backends) + checkpoint_issues(recipe, cfg)
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


def _epochs(steps: Any) -> str:
    if steps.num_epochs is not None:
        return str(steps.num_epochs)
    return "as many as max_steps needs" if steps.max_steps is not None else "1"


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
              f"steps: max_steps={steps.max_steps} num_epochs={_epochs(steps)} "
              f"val every {steps.val_check_interval} ckpt every {steps.checkpoint_interval}",
              f"optimizer: {cfg.optimizer.target if cfg.optimizer else optimizer['_target_'] + ' (default)'}"]
    selection = recipe.pipeline_selection(cfg)
    lines += parallel_plan_lines(cfg, selection.get("sharding", (None, ""))[0])
    lines += [f"pipeline {slot}: {name}" for slot, (name, _) in selection.items()]
    if cfg.distributed is not None and cfg.distributed.activation_checkpointing:
        lines.append("activation checkpointing: every transformer block (before sharding)")
    if cfg.distributed is not None and cfg.distributed.enable_compile:
        lines.append("compile: each transformer block in place (after sharding)")
    if backend_setting(cfg.model, "compile_attn") is True:
        lines.append("compile: each transformer block's attention module in place, fullgraph (model.backend."
                     "compile_attn)")
    ckpt = cfg.checkpoint
    lines.append(f"checkpoints: {ckpt.checkpoint_dir}" if ckpt.enabled else "checkpoints: disabled")
    backends = [spec.name for spec in resolve_backends(cfg, plugins.loggers)[0]]
    if backends:
        lines.append(f"logging: {', '.join(backends)}")
    return lines
