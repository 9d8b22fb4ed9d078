"""Pipeline parallelism over the mesh's ``pp`` dimension with ``torch.distributed.pipelining``.

The settings are upstream's ``distributed.pipeline`` keys (:class:`PipelineSettings`): ``pp_schedule`` (``gpipe``,
``1f1b``; ``interleaved1f1b`` and ``looped_bfs`` run several stages per rank), ``pp_microbatch_size`` (rows per
pipeline micro-batch), ``layers_per_stage``, ``round_virtual_stages_to_pp_multiple``, and ``pp_seq_len`` with
``dtype`` (static stage shapes, :class:`StaticShapes`). The model is cut with
:func:`pipeline_stages.split_model` (on the meta device), each stage then goes through TP / activation
checkpointing / FSDP2 / materialisation like a whole model, and :class:`Pipeline` makes the schedule; a rank's
several stages reach the training loop as one :class:`pipeline_stages.LocalStages`.

The training step delegates its forward and backward to :meth:`Pipeline.step`, one call per batch of the step:
the schedule splits the batch into micro-batches, and its loss function is the engine's: the loss *summed* over
the micro-batch's label tokens, multiplied by ``scale`` (data-parallel size / the step's label tokens, counted
before the schedule runs), so gradients are the unpipelined model's and nothing is averaged per micro-batch
(``scale_grads=False``). The summed loss comes back on every rank of the pipeline.

Stage shapes: torch's stages learn the shapes they send and receive from the first batch (a real forward and backward
of it, stage after stage, dropping the gradients), unless every stage is given example tensors. With ``pp_seq_len``
every training batch is padded to that length and the stages get meta example tensors (:class:`StaticShapes`), so
that shape-finding pass never runs; evaluation pipelines (forward only, any batch) keep finding their shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.parallel.pipeline_plans import has_pipeline_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from automodel.training.parallel.pipeline_stages import PipelineStageModel
    from automodel.training.parallel.pipeline_static import StaticShapes

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B", "loopedbfs": "LoopedBFS"}
INTERLEAVED = ("interleaved1f1b", "loopedbfs")  # several stages per rank
ROUNDING = ("up", "down")
DEFAULT_STAGES_PER_RANK = 2  # interleaved schedules without layers_per_stage
KEPT_SHAPES = 4  # StagePipelines: pipelines kept for the batch shapes used last


@dataclass(frozen=True)
class PipelineSettings:
    """``distributed.pipeline``, upstream's keys and defaults."""

    pp_schedule: str = "1f1b"
    pp_microbatch_size: int = 1
    layers_per_stage: int | None = None
    round_virtual_stages_to_pp_multiple: str | None = None
    pp_seq_len: int | None = None  # every training batch padded to it, the stages' shapes static
    dtype: str | None = None  # the activations' dtype in static shapes (without pp_seq_len: each batch's length)

    @property
    def schedule(self) -> str:
        """The schedule's key in :data:`SCHEDULES` (``Interleaved_1F1B`` and ``interleaved1f1b`` are one)."""
        return self.pp_schedule.lower().replace("_", "")

    @property
    def interleaved(self) -> bool:
        return self.schedule in INTERLEAVED

    @classmethod
    def from_section(cls, section: dict[str, Any] | None) -> PipelineSettings:
        """The settings of a ``distributed.pipeline`` mapping (its other upstream keys are checked by
        :func:`section_issues`)."""
        given = section or {}
        return cls(**{name: given[name] for name in cls.__dataclass_fields__ if name in given})

    def num_stages(self, num_layers: int, pp_size: int) -> int:
        """Stages in all: one per rank, several per rank for interleaved schedules. ``layers_per_stage`` decides
        the count only, as upstream: the layers are then split as evenly as they go (the first stages one more)."""
        if self.layers_per_stage is None:
            return pp_size * (DEFAULT_STAGES_PER_RANK if self.interleaved else 1)
        stages = math.ceil(num_layers / self.layers_per_stage)
        if self.round_virtual_stages_to_pp_multiple == "up":
            return math.ceil(stages / pp_size) * pp_size
        if self.round_virtual_stages_to_pp_multiple == "down":
            return max(pp_size, stages // pp_size * pp_size)
        return stages


# upstream's other distributed.pipeline keys: the value that is what runs here, and why another cannot
UPSTREAM_KEYS = {
    "scale_grads_in_schedule": (False, "the engine scales every micro-batch's loss by the step's label tokens "
                                       "itself, so the schedule must not average gradients"),
    "patch_inner_model": (False, "the stages run the Hugging Face model's own forward, unpatched"),
    "patch_causal_lm_model": (False, "the stages run the Hugging Face model's own forward, unpatched"),
}


def section_issues(section: dict[str, Any] | None, key: str = "distributed.pipeline") -> list[ConfigIssue]:
    """Keys of ``distributed.pipeline`` that are neither :class:`PipelineSettings`' nor upstream's keys whose value
    is what runs here (with pipeline parallelism on)."""
    issues = []
    for name, value in (section or {}).items():
        if name in PipelineSettings.__dataclass_fields__:
            continue
        if name in UPSTREAM_KEYS and value == UPSTREAM_KEYS[name][0]:
            continue
        if name in UPSTREAM_KEYS:
            issues.append(ConfigIssue(f"{key}.{name}", f"{value!r}: {UPSTREAM_KEYS[name][1]}; set it to "
                                      f"{UPSTREAM_KEYS[name][0]!r} or remove it"))
        else:
            known = ", ".join([*PipelineSettings.__dataclass_fields__, *UPSTREAM_KEYS])
            issues.append(ConfigIssue(f"{key}.{name}", f"{value!r}: upstream's setting, which this build's pipeline "
                                      f"does not implement; remove it (the settings that act: {known})"))
    return issues


def describe_stages(model_config: Any, pp_size: int, settings: PipelineSettings, batch: int) -> list[str]:
    """``--dry-run`` lines: the schedule, its micro-batches and the layers each pipeline rank holds (a
    vision-language model's first stage also its vision tower and projector)."""
    from automodel.training.parallel.pipeline_stages import stage_indices, stage_layer_ranges

    num_layers = model_config.get_text_config().num_hidden_layers
    first = ["vision tower + projector"] * (getattr(model_config, "vision_config", None) is not None) + ["embedding"]
    stages = settings.num_stages(num_layers, pp_size)
    ranges = stage_layer_ranges(num_layers, stages)
    size = settings.pp_microbatch_size
    lines = [f"pipeline parallel over pp {pp_size}: {settings.schedule} schedule, {stages} stages, {batch // size} "
             f"micro-batches of {size} rows per batch"]
    for pp_rank in range(pp_size):
        held = []
        for index in stage_indices(pp_rank, pp_size, stages // pp_size):
            parts = [f"layers {ranges[index].start}-{ranges[index].stop - 1}"]
            parts = (first if index == 0 else []) + parts + (["norm, head"] if index == stages - 1 else [])
            held.append(f"stage {index} ({' + '.join(parts)})")
        lines.append(f"  pp rank {pp_rank}: {'; '.join(held)}")
    return lines


def pp_issues(model_config: Any, pp_size: int, settings: PipelineSettings, batch: int,
              section: str = "distributed") -> list[ConfigIssue]:
    """Whether ``model_config``'s model can run ``settings`` over ``pp_size`` stages with ``batch`` rows per
    schedule step (the batch each data-parallel rank feeds the pipeline at once), each problem with the numbers (a
    tied output head is no problem: ``pipeline_tied``)."""
    key = f"{section}.pipeline"
    issues = []
    if settings.schedule not in SCHEDULES:
        issues.append(ConfigIssue(f"{key}.pp_schedule", f"'{settings.pp_schedule}' is not supported here; use "
                                  "gpipe, 1f1b, interleaved1f1b or looped_bfs"))
    if settings.round_virtual_stages_to_pp_multiple not in (None, *ROUNDING):
        issues.append(ConfigIssue(f"{key}.round_virtual_stages_to_pp_multiple", "must be up, down or null, found "
                                  f"{settings.round_virtual_stages_to_pp_multiple!r}"))
    for name in ("pp_microbatch_size", "layers_per_stage"):
        value = getattr(settings, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            issues.append(ConfigIssue(f"{key}.{name}", f"must be a positive integer, found {value!r}"))
    if issues or pp_size == 1:
        return issues
    text = model_config.get_text_config()
    if not has_pipeline_plan(model_config):
        return [ConfigIssue(f"{section}.pp_size", f"{pp_size}: the model ({model_config.model_type}) has no pipeline "
                                                  "plan (base_model_pp_plan); set pp_size: 1")]
    layers = text.num_hidden_layers
    stages = settings.num_stages(layers, pp_size)
    if pp_size > layers or stages > layers:
        issues.append(ConfigIssue(f"{section}.pp_size", f"{pp_size} ranks x {stages // pp_size} stages each = {stages} "
                                  f"stages, but the model has {layers} layers (num_hidden_layers); each stage "
                                  "needs a layer"))
        return issues
    issues += _stage_issues(settings, layers, stages, pp_size, key)
    issues += _microbatch_issues(settings, stages, pp_size, batch, key)
    return issues


def static_issues(settings: PipelineSettings, key: str = "distributed.pipeline") -> list[ConfigIssue]:
    """``pp_seq_len`` a positive integer; ``dtype`` a training dtype (with ``pp_seq_len`` the static shapes of
    that length; without, of each training batch's own length, as upstream's ``update_seq_len``)."""
    from automodel.training.parallel.precision import parse_dtype_name

    length = settings.pp_seq_len
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        return [ConfigIssue(f"{key}.pp_seq_len", f"must be a positive integer (the tokens of every training batch), "
                            f"found {length!r}")]
    if settings.dtype is None:
        return []
    if parse_dtype_name(settings.dtype) is None:
        return [ConfigIssue(f"{key}.dtype", f"{settings.dtype!r} is not a training dtype; use bf16 (bfloat16), fp16 "
                            "(float16) or fp32 (float32)")]
    return []


def _stage_issues(settings: PipelineSettings, layers: int, stages: int, pp_size: int, key: str) -> list[ConfigIssue]:
    where = f"{key}.layers_per_stage" if settings.layers_per_stage is not None else f"{key}.pp_schedule"
    if not settings.interleaved and stages != pp_size:
        return [ConfigIssue(where, f"{settings.layers_per_stage} layers per stage make {stages} stages, but "
                            f"{settings.pp_schedule} runs one stage per rank ({pp_size}); use interleaved1f1b, "
                            f"looped_bfs or layers_per_stage {layers // pp_size}")]
    if stages % pp_size:
        return [ConfigIssue(where, f"{stages} stages do not spread evenly over pp_size {pp_size} ranks; set "
                            "round_virtual_stages_to_pp_multiple: up or down, or change layers_per_stage")]
    if settings.interleaved and stages // pp_size < 2:
        fewer = layers // (2 * pp_size)
        change = f"layers_per_stage {fewer} or lower" if fewer else "gpipe or 1f1b"
        return [ConfigIssue(where, f"{settings.layers_per_stage} layers per stage make {stages} stages, "
                            f"{stages // pp_size} per rank over pp_size {pp_size}, but {settings.pp_schedule} runs "
                            f"at least 2 stages per rank (upstream's rule); use {change}")]
    return []


def _microbatch_issues(settings: PipelineSettings, stages: int, pp_size: int, batch: int, key: str
                       ) -> list[ConfigIssue]:
    size = settings.pp_microbatch_size
    if batch % size:
        return [ConfigIssue(f"{key}.pp_microbatch_size", f"{size} does not divide the {batch} rows each "
                            "data-parallel rank feeds the pipeline per batch; make the batch a multiple of it")]
    count = batch // size
    if settings.schedule == "1f1b" and count < stages:
        return [ConfigIssue(f"{key}.pp_microbatch_size", f"{size} makes {count} micro-batches of the {batch} rows, "
                            f"but 1f1b needs at least one per stage ({stages}); lower pp_microbatch_size")]
    rounds = max(1, count // pp_size)
    if settings.schedule == "interleaved1f1b" and count % rounds:
        return [ConfigIssue(f"{key}.pp_microbatch_size", f"{count} micro-batches are not a multiple of the "
                            f"interleaved schedule's {rounds} rounds (micro-batches // pp_size {pp_size})")]
    return []


def split_for_pipeline(model: nn.Module, pp_mesh: DeviceMesh, settings: PipelineSettings
                       ) -> list[PipelineStageModel]:
    """The stages this rank runs of ``model`` (on the meta device), cut as ``settings`` say."""
    from automodel.training.parallel.pipeline_stages import split_model

    pp_size = pp_mesh.size()
    stages = settings.num_stages(model.config.get_text_config().num_hidden_layers, pp_size)
    return split_model(model, pp_mesh.get_local_rank(), pp_size, stages // pp_size)


class Pipeline:
    """The schedule over this rank's stages. ``loss_sum(output, labels)``: the loss summed over the label tokens of
    one micro-batch (the engine's ``compute_loss`` on the last stage's logits, or on its final hidden states where
    the loss applies the output head, FusedLinearCrossEntropy). With ``shapes`` the stages are built
    with static shapes (every batch then ``shapes.seq_len`` long), without: torch finds them on the first batch."""

    def __init__(self, stages: list[PipelineStageModel], pp_mesh: DeviceMesh, device: torch.device,
                 settings: PipelineSettings, batch: int,
                 loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shapes: StaticShapes | None = None):
        from torch.distributed.pipelining.schedules import get_schedule_class

        from automodel.training.parallel.pipeline_grad_sync import AccumulatingStage, StaticStage

        self.stages, self.batch, self.loss_sum = stages, batch, loss_sum
        self.group = pp_mesh.get_group()
        self.last_rank = dist.get_global_rank(self.group, pp_mesh.size() - 1)
        self.microbatches = batch // settings.pp_microbatch_size
        self._scale = 1.0
        if shapes is None:
            self.runs = [AccumulatingStage(stage, stage.index, stage.num_stages, device, group=self.group)
                         for stage in stages]
        else:
            self.runs = [StaticStage(stage, stage.index, stage.num_stages, device, group=self.group,
                                     **shapes.examples(stage, settings.pp_microbatch_size)) for stage in stages]
        schedule_class = get_schedule_class(SCHEDULES[settings.schedule])
        self.schedule = schedule_class(self.runs if settings.interleaved else self.runs[0], self.microbatches,
                                       loss_fn=self._loss, scale_grads=False)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float, reduce_grads: bool = True,
             keep_gathered: bool = False, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one batch (every rank of the pipeline calls it with the same batch); returns
        its loss summed over the label tokens, on every rank. Gradients accumulate over calls; FSDP2 reduces them
        at the end of this batch only with ``reduce_grads`` (see ``pipeline_grad_sync``)."""
        self._check(inputs)
        self._scale = scale
        for run in self.runs:
            run.reduce_grads, run.keep_gathered = reduce_grads, keep_gathered
        losses: list[torch.Tensor] = []
        self.schedule.step(inputs, target=labels, losses=losses, return_outputs=False, **kwargs)
        return self._gathered_sum(losses, scale, inputs.device)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The forward only: the batch's loss summed over its label tokens, on every rank."""
        self._check(inputs)
        self._scale = 1.0
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            self.schedule.eval(inputs, target=labels, losses=losses, **kwargs)
        return self._gathered_sum(losses, 1.0, inputs.device)

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_sum(output, labels) * self._scale

    def _gathered_sum(self, losses: list[torch.Tensor], scale: float, device: torch.device) -> torch.Tensor:
        """The micro-batches' losses (on the rank holding the last stage) unscaled, summed, sent to every rank."""
        total = torch.stack([loss.detach().float() for loss in losses]).sum() / scale if losses \
            else torch.zeros((), device=device)
        dist.broadcast(total, src=self.last_rank, group=self.group)
        return total

    def _check(self, inputs: torch.Tensor) -> None:
        if inputs.shape[0] != self.batch:
            raise AutomodelError(f"the pipeline was built for batches of {self.batch} rows "
                                 f"({self.microbatches} micro-batches), this one has {inputs.shape[0]}; use "
                                 "drop_last batches of a fixed size with pipeline parallelism")


class StagePipelines:
    """This rank's stages run by :class:`Pipeline` s, one per batch shape: torch's pipeline stages size their
    send and receive buffers from the first batch they run, so a batch of another shape gets a pipeline of its own.
    That first run also drops the stages' gradients (torch runs a real forward and backward to learn the shapes),
    so every batch of one optimizer step must have the step's shape (the loop asks the recipe for that). The
    pipelines of the :data:`KEPT_SHAPES` shapes used last are kept (each holds buffers for its micro-batches).
    With ``shapes`` (``pp_seq_len``, or ``dtype`` alone: each batch's own length) the training pipelines are built
    with static shapes instead, no such first run. With ``cp_mesh`` (context parallelism) each training batch is
    split over its ranks first (``context_parallel.pipeline_parts``; the token ids of a vision-language model's
    first stage stay whole, it splits after merging the media); evaluation runs whole sequences, its targets
    shifted as well (neither shifts where ``labels_shifted``: the data's labels are the next tokens already).
    Evaluation runs GPipe, or LoopedBFS (its form for several stages per rank), forward only (the schedule changes
    nothing there), with micro-batches that divide the batch, so a shorter last validation batch runs too."""

    def __init__(self, stages: list[PipelineStageModel], pp_mesh: DeviceMesh, device: torch.device,
                 settings: PipelineSettings, loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 shapes: StaticShapes | None = None, cp_mesh: DeviceMesh | None = None):
        self.stages, self.pp_mesh, self.device, self.settings, self.loss_sum = stages, pp_mesh, device, settings, \
            loss_sum
        self.shapes, self.cp_mesh = shapes, cp_mesh
        # a composite model's first stage here: it takes the whole rows' token ids under context parallelism
        self.whole_inputs = any(getattr(stage, "takes_whole_rows", False) for stage in stages)
        self.group = pp_mesh.get_group()
        self.labels_shifted = False  # the recipe's data sets' labels are the next tokens already (set at its setup)
        self._pipelines: dict[tuple[bool, tuple[int, ...]], Pipeline] = {}

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float, reduce_grads: bool = True,
             keep_gathered: bool = False, **kwargs: Any) -> torch.Tensor:
        """:meth:`Pipeline.step` with the pipeline for this batch's shape (with static shapes: every batch
        ``pp_seq_len`` long, else an ``AutomodelError`` naming the key); with context parallelism on this rank's
        part of the batch, ``labels`` then its next-token targets (what ``loss_sum`` gets)."""
        length = inputs.shape[1]
        if self.shapes is not None and self.shapes.seq_len is not None and length != self.shapes.seq_len:
            raise AutomodelError(f"distributed.pipeline.pp_seq_len: {self.shapes.seq_len}, but this step's batches "
                                 f"are {length} tokens long (padded); raise pp_seq_len to at least {length} or make "
                                 "the samples shorter (the dataset's maximum length)")
        if self.cp_mesh is not None:
            from automodel.training.parallel.context_parallel import pipeline_parts

            inputs, labels, kwargs = pipeline_parts(self.cp_mesh, inputs, labels, kwargs,
                                                    whole_inputs=self.whole_inputs, shifted=self.labels_shifted)
        return self._pipeline(True, inputs, self.settings, length).step(inputs, labels, scale, reduce_grads,
                                                                        keep_gathered, **kwargs)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """:meth:`Pipeline.evaluate` with the (GPipe / LoopedBFS) pipeline for this batch's shape (whole sequences;
        with context parallelism ``loss_sum`` takes next-token targets, as in training)."""
        if self.cp_mesh is not None:
            from automodel.training.parallel.context_parallel import next_token_targets

            labels = next_token_targets(labels, shifted=self.labels_shifted)
        rows, size = inputs.shape[0], self.settings.pp_microbatch_size
        schedule = "gpipe" if len(self.stages) == 1 else "loopedbfs"
        settings = PipelineSettings(pp_schedule=schedule, pp_microbatch_size=size if rows % size == 0 else 1)
        return self._pipeline(False, inputs, settings, inputs.shape[1]).evaluate(inputs, labels, **kwargs)

    def _pipeline(self, train: bool, inputs: torch.Tensor, settings: PipelineSettings, length: int) -> Pipeline:
        """The pipeline for ``inputs`` (this rank's part of batches ``length`` tokens long)."""
        key = (train, tuple(inputs.shape))
        if key in self._pipelines:
            self._pipelines[key] = self._pipelines.pop(key)  # the most recently used last
        else:
            if len(self._pipelines) >= KEPT_SHAPES:
                del self._pipelines[next(iter(self._pipelines))]
            rows = inputs.shape[0]
            found = _microbatch_issues(settings, len(self.stages) * self.pp_mesh.size(), self.pp_mesh.size(), rows,
                                       "distributed.pipeline")
            if found:
                raise AutomodelError(f"a batch of {rows} rows: {found[0].key}: {found[0].message}")
            shapes = self.shapes.of_length(length) if train and self.shapes is not None else None
            self._pipelines[key] = Pipeline(self.stages, self.pp_mesh, self.device, settings, rows, self.loss_sum,
                                            shapes)
        return self._pipelines[key]
