"""automodel-diffusion: text-to-image diffusion recipes. Importing this package imports no torch.

``AutoDiffusionPipeline`` (``automodel_diffusion.pipeline``) is loaded on first access, so that the plugin
module — imported whenever the CLI starts — stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from automodel_diffusion.pipeline import AutoDiffusionPipeline

__all__ = ["AutoDiffusionPipeline"]


def __getattr__(name: str) -> Any:
    if name == "AutoDiffusionPipeline":
        from automodel_diffusion.pipeline import AutoDiffusionPipeline

        return AutoDiffusionPipeline
    raise AttributeError(f"module 'automodel_diffusion' has no attribute '{name}'")
