"""The plugin system: hook markers, hookspecs, registries and the manager."""

from automodel.plugins.markers import hookimpl, hookspec
from automodel.training.pipeline import PIPELINE_SLOTS

__all__ = ["PIPELINE_SLOTS", "hookimpl", "hookspec"]
