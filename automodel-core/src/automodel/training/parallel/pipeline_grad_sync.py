"""When a pipeline stage reduces its FSDP2 gradients: once per optimizer step, as without pipeline parallelism.

torch's pipeline stage keeps FSDP2's gradients unsynced (and the gathered parameters gathered) over the
micro-batches of one ``schedule.step`` and reduce-scatters them at its end (``perform_reduce_grad``). A training
step that accumulates several batches calls ``schedule.step`` once per batch, so torch alone would reduce after
every batch. :class:`AccumulatingStage` lets the loop say per batch what the run's keys ask:
``distributed.defer_fsdp_grad_sync`` (default true): reduce after the step's last batch only, accumulating the
unsharded gradients until then; ``model.backend.enable_fsdp_optimizations: true``: also keep the parameters gathered
from one batch to the next (no re-gather), resharded after the last. :class:`StaticStage` is that stage built with
static shapes (:mod:`automodel.training.parallel.pipeline_static` plans them; this module holds the stage classes so
that validation, which reads that plan, does not import torch's pipelining).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage

from automodel.errors import AutomodelError
from automodel.training.parallel.precision import dtype_name


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


class StaticStage(AccumulatingStage):
    """An :class:`AccumulatingStage` built with example tensors (torch's STATIC mode); its first micro-batch's
    output is compared with the example's shape and dtype (an ``AutomodelError`` naming the keys on a mismatch)."""

    def __init__(self, *args: Any, input_args: Any, output_args: Any, **kwargs: Any):
        super().__init__(*args, input_args=input_args, output_args=output_args, **kwargs)
        first = output_args[0] if isinstance(output_args, tuple) else output_args  # the hidden states / logits
        self.expected: tuple[tuple[int, ...], torch.dtype] | None = (tuple(first.shape), first.dtype)

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        outputs = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        output = outputs[0] if isinstance(outputs, tuple) else outputs
        if self.expected is not None:
            shape, dtype = self.expected
            self.expected = None
            if tuple(output.shape) != shape or output.dtype != dtype:
                raise AutomodelError(
                    f"distributed.pipeline: pipeline stage {self.stage_index} returns "
                    f"{list(output.shape)} {dtype_name(output.dtype)}, but its static shape is {list(shape)} "
                    f"{dtype_name(dtype)}; set distributed.pipeline.dtype to {dtype_name(output.dtype)} if that is the "
                    "hidden states' dtype, or remove pp_seq_len and dtype (the shapes are then found on the first "
                    "batch)")
        return outputs
