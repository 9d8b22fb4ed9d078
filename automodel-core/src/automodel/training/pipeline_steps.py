"""Pipeline parallelism in the loop (``distributed.pp_size > 1``): what a recipe provides to run pipelined, and the
step and validation forwards that go through the schedule (``parallel/pipeline_parallel.py``) instead of
``compute_loss``. ``TrainingLoop`` is built on it; a recipe opts in by implementing ``pipeline_batches`` and
``pipeline_loss`` and setting ``pipeline_parallel_unsupported = None``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from automodel.errors import AutomodelError, ConfigIssue
from automodel.model_backend import backend_setting
from automodel.training.context import BuildContext
from automodel.training.distributed_section import grad_sync_deferred, moe_head_fp32
from automodel.training.loss import IGNORE_INDEX, LINEAR, loss_fn_named
from automodel.training.modules import unwrap
from automodel.training.parallel.mesh import CP, PP
from automodel.training.parallel.pipeline_parallel import PipelineSettings, StagePipelines
from automodel.training.parallel.pipeline_stages import stage_models, stages_of
from automodel.training.parallel.pipeline_static import StaticShapes, activations_dtype, logits_dtype
from automodel.training.parallel.pipeline_tied import TiedHead
from automodel.training.parallel.precision import parse_dtype_name
from automodel.training.parallel.tensor_parallel import local_loss
from automodel.training.parallelism import pipeline_settings

PIPELINE_LENGTH_MULTIPLE = 64  # pipelined batches are padded to a multiple of it: few shapes, few pipeline set-ups


def pipeline_length(batches: list[dict[str, torch.Tensor]], length: int | None = None) -> int:
    """The length a step's micro-batches are padded to for the pipeline: ``length`` where they fit in it, else their
    longest rounded up to a multiple of ``PIPELINE_LENGTH_MULTIPLE`` (the pipeline runs one shape per step and sets
    up anew for a new shape)."""
    longest = max(batch["input_ids"].shape[1] for batch in batches)
    return length if length is not None and longest <= length else \
        -(-longest // PIPELINE_LENGTH_MULTIPLE) * PIPELINE_LENGTH_MULTIPLE


def padded_tokens(batch: dict[str, torch.Tensor], extra: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of ``batch`` with ``extra`` padding positions, which carry no label."""
    return (torch.nn.functional.pad(batch["input_ids"], (0, extra), value=pad),
            torch.nn.functional.pad(batch["labels"], (0, extra), value=IGNORE_INDEX))


def padded_mask(batch: dict[str, torch.Tensor], extra: int) -> torch.Tensor:
    """``batch``'s attention mask (all ones where it has none) with ``extra`` masked-out padding positions."""
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    return torch.nn.functional.pad(mask, (0, extra), value=0)


def stage_kwargs(batch: dict[str, torch.Tensor], extra: int) -> dict[str, torch.Tensor]:
    """The keyword arguments every stage gets for ``batch`` with ``extra`` padding positions (torch's schedule hands
    each stage the micro-batch's). Packed rows (position ids that restart at each sample, no attention mask): their
    position ids, the padding a segment of its own, so the model keeps every stage's attention within each sample
    from the restarts, as in one process. Other rows: their attention mask with the padding masked out, and their
    position ids where they carry them. Multi-axis position ids (a vision-language model's rope) come rows first,
    ``[rows, axes, length]`` (the schedule splits every keyword argument along dim 0; the stages take them back)."""
    positions = batch.get("position_ids")
    if "attention_mask" in batch or positions is None:
        kwargs = {"attention_mask": padded_mask(batch, extra)}
        if positions is not None:
            kwargs["position_ids"] = torch.nn.functional.pad(positions, (0, extra), value=0)
        return kwargs
    restart = torch.arange(extra, device=positions.device, dtype=positions.dtype).expand(*positions.shape[:-1], extra)
    return {"position_ids": torch.cat([positions, restart], dim=-1)}


def generation_issues(cfg: Any) -> list[ConfigIssue]:
    """``eval_generation`` with ``pp_size > 1``: generation runs the whole model token by token."""
    pp = cfg.distributed.pp_size if cfg.distributed is not None else 1
    generation = cfg.get("eval_generation") if "eval_generation" in cfg else None
    if pp > 1 and generation is not None and getattr(generation, "enabled", False):
        return [ConfigIssue("eval_generation.enabled", f"generation runs the whole model token by token, which the "
                            f"pipeline stages (pp_size {pp}) hold apart; set eval_generation.enabled: false")]
    return []


class PipelineSteps:
    """The pipelined forms of a training step and a validation batch (``self.pipelines`` None: not pipelined)."""

    # why distributed.pp_size > 1 is refused (None: the recipe implements pipeline_batches and pipeline_loss)
    pipeline_parallel_unsupported: ClassVar[str | None] = (
        "this recipe's model and loss are not set up for pipeline parallelism (the LLM fine-tuning and pretraining "
        "recipe and the VLM fine-tuning recipe are); use pp_size: 1")
    pipelines: StagePipelines | None = None
    tied_head: TiedHead | None = None  # a tied output head's two copies (first and last stage), when pipelined

    def pipeline_batches(self, batches: list[Any], length: int | None = None
                         ) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        """Pipeline parallelism: each micro-batch of a step (on the device) as ``(inputs, targets, keyword
        arguments of every stage)``, all of one shape (see ``StagePipelines``): ``length`` long (dim 1) where they fit
        in it, else longer."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_batches to run pipelined")

    def pipeline_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Pipeline parallelism: the loss *summed* over the label tokens of the last stage's ``output`` for one
        pipeline micro-batch (``compute_loss`` on logits); with context parallelism (``ctx.mesh.cp > 1``) on this
        rank's part of the sequences, ``targets`` then already the next tokens' labels (shifted before the split,
        as in ``ContextParallelBatch``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_loss to run pipelined")

    def build_pipelines(self, ctx: BuildContext) -> StagePipelines | None:
        """The schedules over this rank's stages (``self.model`` after the build pipeline), when pipelined."""
        if ctx.mesh.pp == 1:
            return None
        settings = pipeline_settings(ctx.cfg)
        stages = stages_of(unwrap(self.model))
        self.tied_head = next((s.tied_head for s in stage_models(unwrap(self.model)) if hasattr(s, "tied_head")), None)
        shapes = None
        if settings.pp_seq_len is not None or settings.dtype is not None:
            shapes = static_shapes(ctx, stages[0], settings)
            whole_rows = any(getattr(stage, "takes_whole_rows", False) for stage in stages)
            self.log(shapes.describe(settings.pp_microbatch_size, whole_rows))
        cp_mesh = ctx.device_mesh[CP] if ctx.mesh.cp > 1 else None  # each batch split over it before the schedule
        return StagePipelines(stages, ctx.device_mesh[PP], ctx.device, settings, self.pipeline_loss, shapes, cp_mesh)

    def _pipelined(self, batches: list[Any], scale: float) -> torch.Tensor:
        """Pipeline parallelism: each micro-batch of the step through the schedule, forward and backward together;
        FSDP2's gradients are reduced after the step's last one (``distributed.defer_fsdp_grad_sync``, default
        true; false: after each), the parameters kept gathered in between with ``model.backend.
        enable_fsdp_optimizations: true``; the step's loss summed over its label tokens."""
        if self.grad_scaler is not None:
            raise AutomodelError("fp16 loss scaling is not wired into the pipeline schedule; train in bf16 or fp32 "
                                 "(distributed.mp_policy.param_dtype) with distributed.pp_size > 1")
        total = torch.zeros((), device=self.device)
        with self.batch_errors(batches[0], "dataloader"):
            moved = [self.move_to_device(batch) for batch in batches]
            shapes = self.pipelines.shapes
            fixed = shapes.seq_len if shapes is not None else None
            parts = self._agreed_shape(moved) if fixed is None else self.pipeline_batches(moved, fixed)
        keep = bool(backend_setting(self.cfg.model, "enable_fsdp_optimizations"))
        defer = grad_sync_deferred(self.cfg.distributed, self.cfg.model)
        for index, (inputs, targets, kwargs) in enumerate(parts):
            last = index == len(parts) - 1
            with self.forward_context():
                total += self.pipelines.step(inputs, targets, scale, reduce_grads=last or not defer,
                                             keep_gathered=keep and not last, **kwargs)
        if self.tied_head is not None:  # a trained tied head: its two copies' gradients summed (pipeline_tied)
            self.tied_head.sum_grads()
        return total

    def _validation_loss(self, batch: Any) -> torch.Tensor:
        """One validation batch's loss summed over its label tokens (through the pipeline where there is one)."""
        if self.pipelines is None:
            return local_loss(self.compute_loss(self.model, self.move_to_device(batch))).float()
        ((inputs, targets, kwargs),) = self._agreed_shape([self.move_to_device(batch)])
        return self.pipelines.evaluate(inputs, targets, **kwargs)

    def _agreed_shape(self, batches: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        """``pipeline_batches`` as long as the longest of every data-parallel rank's: a pipeline sets up anew for a
        new shape, running FSDP2's collectives, so the data-parallel ranks must change shape together."""
        parts = self.pipeline_batches(batches)
        if self.ctx.mesh.dp == 1:
            return parts
        length = torch.tensor(parts[0][0].shape[1], device=self.device)
        torch.distributed.all_reduce(length, op=torch.distributed.ReduceOp.MAX, group=self.data_parallel_group())
        return parts if int(length) == parts[0][0].shape[1] else self.pipeline_batches(batches, int(length))


def static_shapes(ctx: BuildContext, stage: torch.nn.Module, settings: PipelineSettings) -> StaticShapes:
    """The stages' static shapes for ``pp_seq_len`` (None: each batch's length): the model's hidden and vocabulary
    sizes, the activations in ``distributed.pipeline.dtype`` (checked against the run's precision at validation
    where the config names the dtypes), else in the dtype the run's precision gives them; the logits in the dtype
    it gives them (none with FusedLinearCrossEntropy: the last stage returns hidden states, the loss applies the
    head)."""
    text = stage.config.get_text_config()
    storage = next(stage.parameters()).dtype
    given = parse_dtype_name(settings.dtype) if settings.dtype is not None else None
    return StaticShapes(settings.pp_seq_len, text.hidden_size, text.vocab_size,
                        given or activations_dtype(ctx.precision, storage),
                        logits_dtype(ctx.precision, storage, moe_head_fp32(ctx.cfg.distributed)),
                        head_in_loss=loss_fn_named(ctx.cfg, LINEAR) is not None, cp=ctx.mesh.cp,
                        carried=stage.carry.depths if stage.carry is not None else 0)
