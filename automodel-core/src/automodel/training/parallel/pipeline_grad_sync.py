"""When a pipeline stage reduces its FSDP2 gradients: once per optimizer step, as without pipeline parallelism.

torch's pipeline stage keeps FSDP2's gradients unsynced (and the gathered parameters gathered) over the
micro-batches of one ``schedule.step`` and reduce-scatters them at its end (``perform_reduce_grad``). A training
step that accumulates several batches calls ``schedule.step`` once per batch, so torch alone would reduce after
every batch. :class:`AccumulatingStage` lets the loop say per batch what the run's keys ask:
``distributed.defer_fsdp_grad_sync`` (default true): reduce after the step's last batch only, accumulating the
unsharded gradients until then; ``model.backend.enable_fsdp_optimizations: true``: also keep the parameters gathered
from one batch to the next (no re-gather), resharded after the last.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage


class AccumulatingStage(PipelineStage):
    """A ``PipelineStage`` whose end-of-``step`` gradient reduction can wait for a later step: with
    ``reduce_grads`` false the batch's gradients are accumulated unsharded (what FSDP2 does for a backward with
    ``set_requires_gradient_sync(False)``) and the parameters resharded unless ``keep_gathered``. The schedules
    here never scale gradients (``scale_grads=False``: the loss carries the scale)."""

    reduce_grads: bool = True
    keep_gathered: bool = False

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.reduce_grads or not isinstance(self.submod, FSDPModule):
            super().perform_reduce_grad(grad_scale_factor)
            return
        module = self.submod
        module.set_is_last_backward(False)
        module.set_requires_gradient_sync(False)
        module.set_reshard_after_backward(not self.keep_gathered)
        # what torch's own stage does at the end of a step (its backward bypasses FSDP2's autograd hooks), with the
        # reduction off: each parameter group accumulates its gradients, then the per-step state is reset
        state = fully_shard.state(module)
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
