"""The infrastructure pipeline: fixed slots in a fixed order, owned by the core (DESIGN §8).

For each slot the recipe says which registered implementation (if any) acts for this config; the pipeline
calls them in slot order and logs one line per stage that acted. Plugins add implementations, never slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from automodel.errors import AutomodelError, ConfigIssue, PluginError
from automodel.plugins.registries import PIPELINE_SLOTS, StageRegistry

if TYPE_CHECKING:
    from automodel.training.recipe import TrainRecipe


def missing_stages(selection: dict[str, tuple[str, str]], stages: StageRegistry) -> list[ConfigIssue]:
    """Validation: a configured stage whose implementation is not installed."""
    issues = []
    for slot, (name, key) in selection.items():
        if (slot, name) not in stages.stages:
            have = ", ".join(stages.implementations(slot)) or "none installed"
            issues.append(ConfigIssue(key, f"pipeline stage '{slot}' needs implementation '{name}', which is not "
                                           f"installed (available: {have})"))
    return issues


def apply_pipeline(recipe: TrainRecipe, model: Any, selection: dict[str, tuple[str, str]], stages: StageRegistry,
                   log: Callable[[str], None]) -> Any:
    """Run each selected stage in slot order. A stage returns the (possibly wrapped) model, or a message."""
    for slot in PIPELINE_SLOTS:
        if slot not in selection:
            continue
        name, _ = selection[slot]
        try:
            result = stages.get(slot, name)(recipe, model)
        except AutomodelError:
            raise
        except Exception as err:  # a plugin's stage failed: name the plugin (the core's own propagate as they are)
            stage = stages.stages.get((slot, name))
            if stage is None or stage.source in ("core", "automodel-core"):
                raise
            raise PluginError(f"pipeline stage '{slot}' [{name}] registered by plugin '{stage.source}' failed: "
                              f"{type(err).__name__}: {err} (AUTOMODEL_DEBUG=1 shows the traceback)") from err
        if isinstance(result, tuple):
            model, message = result
        elif isinstance(result, str) or result is None:
            message = result
        else:
            model, message = result, None
        log(f"pipeline: {slot} [{name}]" + (f": {message}" if message else ""))
    return model
