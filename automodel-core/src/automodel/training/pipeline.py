"""The infrastructure pipeline: fixed slots in a fixed order, owned by the core (DESIGN §8).

Each slot is one module, ``automodel.training.stages.<slot>``, holding the slot's ``select(cfg)`` (whether it
acts for a config, with which implementation by default, and which config key asked), its ``issues(cfg,
implementation)`` (what the config asks that this machine or build cannot do) and the core's implementations. A
recipe may name another registered implementation for a slot (``TrainRecipe.stage_implementations``) or refuse
a slot with a reason (``TrainRecipe.unsupported_stages``). Plugins add implementations, never slots or an order.

Importing this module imports no torch (the plugin registries read the slot order from here).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from automodel.errors import AutomodelError, ConfigIssue, PluginError

if TYPE_CHECKING:
    from automodel.config import Config
    from automodel.plugins.registries import StageRegistry
    from automodel.training.context import BuildContext

# The slots, in the order the core applies them. Plugins fill slots; they never add slots or change the order.
PIPELINE_SLOTS = ("peft", "fp8", "qat", "checkpoint", "freeze", "sharding", "device", "compile", "context_parallel")

# Slots whose stages get a model with values: a meta-device model is materialised before the first of them acts
AFTER_MATERIALISATION = ("sharding", "device", "compile", "context_parallel")

# slot -> (implementation name, config key that asked for it), for the stages that act
Selection = dict[str, tuple[str, str]]


def slot_module(slot: str) -> ModuleType:
    return importlib.import_module(f"automodel.training.stages.{slot}")


def select_stages(cfg: Config, implementations: Mapping[str, str], unsupported: Mapping[str, str]) -> Selection:
    """The stages that act for ``cfg``, in slot order; a recipe's ``implementations`` replace the defaults and
    its ``unsupported`` slots never act (validation refuses a config that asks for one)."""
    chosen: Selection = {}
    for slot in PIPELINE_SLOTS:
        found = slot_module(slot).select(cfg)
        if found is not None and slot not in unsupported:
            name, key = found
            chosen[slot] = (implementations.get(slot, name), key)
    return chosen


def pipeline_issues(cfg: Config, stages: StageRegistry, implementations: Mapping[str, str],
                    unsupported: Mapping[str, str]) -> list[ConfigIssue]:
    """Validation: every slot's own checks, refused slots, and selected implementations that are not installed."""
    issues: list[ConfigIssue] = []
    for slot in PIPELINE_SLOTS:
        issues += slot_module(slot).issues(cfg, implementations.get(slot))
    for slot, reason in unsupported.items():
        found = slot_module(slot).select(cfg)
        if found is not None:
            issues.append(ConfigIssue(found[1], reason))
    issues += missing_stages(select_stages(cfg, implementations, unsupported), stages)
    return issues


def missing_stages(selection: Selection, stages: StageRegistry) -> list[ConfigIssue]:
    """A configured stage whose implementation is not installed."""
    issues = []
    for slot, (name, key) in selection.items():
        if (slot, name) not in stages.stages:
            have = ", ".join(stages.implementations(slot)) or "none installed"
            issues.append(ConfigIssue(key, f"pipeline stage '{slot}' needs implementation '{name}', which is not "
                                           f"installed (available: {have})"))
    return issues


def apply_pipeline(ctx: BuildContext, model: Any, selection: Selection) -> Any:
    """Run each selected stage in slot order as ``fn(ctx, model) -> (model, message)``; log one line per stage.

    First ``distributed.pp_size > 1`` cuts the model to this rank's pipeline stage (the stages after see only it);
    a rank running several stages (an interleaved schedule) puts each through the slots on its own and returns
    them as one :class:`LocalStages`; a tied output head is then made the first stage's input embedding.
    Before the ``sharding`` slot, ``distributed.tp_size > 1`` shards the model over the mesh's ``tp`` dimension
    (validation made the sharding slot FSDP2), ``distributed.ep_size > 1`` splits the experts of a MoE model over
    the data-parallel ranks (neither where the recipe split another model with them: ``ctx.splits_run_model``), then
    ``distributed.activation_checkpointing`` wraps the transformer blocks; a model built on the meta device is
    materialised before the first stage from ``sharding`` on that needs values (every stage but one marked
    ``shards_meta_models``, the core's FSDP2, which materialises after sharding)."""
    from automodel.training import model_init

    settings = ctx.cfg.distributed
    if settings is None or settings.pp_size == 1:
        return _apply_slots(ctx, model, selection)
    from automodel.training.parallel.pipeline_stages import LocalStages

    parts, message = model_init.pipeline_stages(ctx, model)
    ctx.log(f"pipeline: {message}")
    built = [_apply_slots(ctx, part, selection) for part in parts]
    if (tied := model_init.tie_stages(parts)) is not None:
        ctx.log(f"pipeline: {tied}")
    for part in parts:
        part.release_whole_model()
    return built[0] if len(built) == 1 else LocalStages(built)


def _apply_slots(ctx: BuildContext, model: Any, selection: Selection) -> Any:
    """The slots of :func:`apply_pipeline` on one model (or one pipeline stage)."""
    from automodel.training import model_init

    stages = ctx.plugins.stages
    settings = ctx.cfg.distributed
    split_experts = settings is not None and (settings.ep_size or 1) > 1 and ctx.splits_run_model
    split_tensors = settings is not None and settings.tp_size > 1 and ctx.splits_run_model
    for slot in PIPELINE_SLOTS:
        if slot == "sharding" and split_tensors:
            ctx.log(f"pipeline: {model_init.tensor_parallelize(ctx, model)}")
        if slot == "sharding" and split_experts:
            ctx.log(f"pipeline: {model_init.expert_parallelize(ctx, model)}")
        if slot == "sharding" and settings is not None and settings.activation_checkpointing:
            ctx.log(f"pipeline: {model_init.checkpoint_activations(ctx, model)}")
        if slot not in selection:
            continue
        name, _ = selection[slot]
        stage = stages.stages[(slot, name)]
        fn = stages.get(slot, name)
        if slot in AFTER_MATERIALISATION and not getattr(fn, "shards_meta_models", False) \
                and model_init.on_meta(model):
            ctx.log(f"pipeline: {model_init.materialize_model(ctx, model)}")
        plugin = stage.source not in ("core", "automodel-core")
        try:
            result = fn(ctx, model)
        except AutomodelError:
            raise
        except Exception as err:  # a plugin's stage failed: name the plugin (the core's own propagate as they are)
            if not plugin:
                raise
            raise PluginError(f"pipeline stage '{slot}' [{name}] registered by plugin '{stage.source}' failed: "
                              f"{type(err).__name__}: {err} (AUTOMODEL_DEBUG=1 shows the traceback)") from err
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], (str, type(None)))):
            raise PluginError(f"pipeline stage '{slot}' [{name}] registered by '{stage.source}' returned "
                              f"{type(result).__name__}; a stage returns (model, message)")
        model, message = result
        ctx.log(f"pipeline: {slot} [{name}]" + (f": {message}" if message else ""))
    return model
