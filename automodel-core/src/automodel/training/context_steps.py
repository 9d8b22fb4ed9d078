"""Context parallelism in the loop (``distributed.cp_size > 1``): what a micro-batch's loss and backward run on,
this rank's part of its sequences inside the context-parallel region (``parallel/context_parallel.py``), with the
attention ``distributed.cp_attention`` chooses.
``TrainingLoop`` is built on it; a recipe opts in by implementing ``context_parallel_batch`` (``NextTokenLogits``
does), taking its result in ``compute_loss``, and setting ``context_parallel_unsupported = None``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from automodel.training.modules import unwrap
from automodel.training.parallel.context_parallel import ContextParallelBatch, context_parallel_region, cp_attention
from automodel.training.parallel.mesh import CP


class ContextParallelSteps:
    """The micro-batch a step's loss runs on, split over the mesh's ``cp`` ranks where it has more than one."""

    # why distributed.cp_size > 1 is refused (None: the recipe defines context_parallel_batch and its loss takes it)
    context_parallel_unsupported: ClassVar[str | None] = (
        "this recipe does not split its sequences over context-parallel ranks (the LLM fine-tuning and pre-training "
        "recipes and the VLM fine-tuning recipe do); use cp_size: 1")

    def context_parallel_batch(self, batch: Any) -> ContextParallelBatch:
        """A micro-batch (on the device) as context parallelism splits it; ``compute_loss`` then gets this rank's
        part (its targets already the next tokens' labels: no second shift)."""
        raise NotImplementedError(f"{type(self).__name__} must implement context_parallel_batch(batch)")

    @contextlib.contextmanager
    def sequence_parts(self, batch: Any) -> Iterator[Any]:
        """What a micro-batch's loss and backward run on: the batch on the device; with context parallelism this
        rank's part of its sequences (``context_parallel_batch``: tokens, positions, next-token targets), the
        forward and backward inside the context-parallel region over the mesh's ``cp`` group (the attention the
        context_parallel stage chose: the same function of the config, device and model)."""
        batch = self.move_to_device(batch)
        if self.ctx.mesh.cp == 1:
            yield batch
            return
        with self.batch_errors(batch, "dataloader"):
            split = self.context_parallel_batch(batch)
        attention = cp_attention(self.cfg, self.device, getattr(unwrap(self.model), "config", None))
        with context_parallel_region(self.ctx.device_mesh[CP], split, attention):
            yield split
