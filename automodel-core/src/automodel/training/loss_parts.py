"""Named parts of the training loss (a drafter's beside its base model's, say), logged beside ``loss``."""

from __future__ import annotations

import math
from typing import Any

import torch

from automodel.training.dist import all_reduce_sum
from automodel.training.parallel.mesh import CP


class LossParts:
    """The loop's record of a step's loss parts (``ctx``, ``device`` and ``data_parallel_group`` are the loop's)."""

    ctx: Any
    device: torch.device

    # the last step's record fields beside the loss: loss_<name> values (add_loss_part), a recipe's own (moe_metrics)
    step_loss_parts: dict[str, float | None] = {}
    _loss_parts: dict[str, torch.Tensor]  # the step's so far, taken by loss_parts_of_step

    def add_loss_part(self, name: str, loss_sum: torch.Tensor) -> None:
        """A named part of a training micro-batch's summed loss (a drafter's, say), which a recipe's
        ``compute_loss`` adds into what it returns: the step's MetricsSample carries ``loss_<name>``, that part's
        sum over the step divided by the step's label tokens, as ``loss`` is."""
        parts = self.__dict__.setdefault("_loss_parts", {})
        parts[name] = parts.get(name, 0.0) + loss_sum.detach().float()

    def data_groups(self) -> list[Any]:
        """The process groups a step's sums over its data go through: the data-parallel one, then the
        context-parallel one (each only where it has more than one rank)."""
        mesh = self.ctx.mesh
        return [group() for size, group in ((mesh.dp, self.data_parallel_group),
                                            (mesh.cp, lambda: self.ctx.device_mesh[CP].get_group())) if size > 1]

    def loss_parts_of_step(self, denominator: float) -> dict[str, float | None]:
        """The step's :meth:`add_loss_part` sums, summed over the ranks as the loss is, per label token."""
        parts = self.__dict__.pop("_loss_parts", {})
        if not parts:
            return {}
        values = list(parts.values())
        for group in self.data_groups():
            values = all_reduce_sum(*values, device=self.device, group=group)
        means = {f"loss_{name}": float(value) / denominator for name, value in zip(parts, values, strict=True)}
        return {name: mean if math.isfinite(mean) else None for name, mean in means.items()}
