"""A separate-mesh teacher copy over several ranks by context or pipeline parallelism (``teacher_distributed.cp_size``
or ``pp_size``): each computes, on the copy's leader, the logits a student rank computes with the teacher beside it
(``next_token_logits``: the label positions' rows where the batch names them, else every position but each row's
last), which the leader sends to the students as with a teacher on one rank.

Context parallelism: every rank of the copy gets the whole micro-batch, keeps its part of each sequence (the core's
load-balanced split, padded at the end to a multiple of ``2 x cp_size`` positions: causal attention keeps that
padding out of every real token) and runs the teacher in the core's all-gather attention region (any device; its
mask from the whole rows' positions and padding); the parts' logits are gathered and put back in sequence order.
With ``teacher_distributed.strategy: fsdp2`` the copy's weights are sharded over its ranks (FSDP2 over the ``cp``
ranks, as upstream shards over ``dp_shard x cp``) and gathered block by block in the forward.

Pipeline parallelism: each rank holds one stage of the teacher (the core's cut, ``pipeline_stages.split_model``)
and runs the forward of torch's schedule (``teacher_distributed.pipeline.pp_schedule``: gpipe or 1f1b, with no loss
function, so no backward) over micro-batches of ``pp_microbatch_size`` rows; the last stage returns the whole
batch's logits, so the copy's leader is its last rank. A teacher whose output head is tied to its input embedding
gets an exact copy of that weight as its head's (frozen, they stay equal), so the first and last stage each hold
one. A batch those settings do not split (a shorter last
validation batch) runs GPipe in micro-batches of one row: forward only, the logits are the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.next_token import LABEL_POSITIONS
from automodel.training.parallel.context_parallel import (
    ContextParallelBatch,
    built_attention_issue,
    causal_attention_without_mask,
    context_parallel_region,
    cp_issues,
    eager_issue,
)
from automodel.training.parallel.pipeline_parallel import (
    KEPT_SHAPES,
    SCHEDULES,
    PipelineSettings,
    pp_issues,
    section_issues,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PIPELINE_KEY = "teacher_distributed.pipeline"
FORWARD_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank; forward only


def cp_teacher_issues(cfg: Any, cp: int, hf_config: Any) -> list[ConfigIssue]:
    """Whether the teacher can run the all-gather attention over ``cp`` ranks (its SDPA calls are replaced; eager
    attention runs as SDPA there) with its ``attn_implementation`` (``hf_config``: its config, where readable)."""
    teacher = cfg.teacher_model
    implementation = teacher.get("attn_implementation") if teacher is not None else None
    issues = [ConfigIssue("teacher_model.attn_implementation", _for_teacher(issue.message))
              for issue in cp_issues("cpu", cp, implementation, "teacher_distributed", "all_gather")]
    if implementation == "eager" and hf_config is not None and (why := eager_issue(hf_config)) is not None:
        issues.append(ConfigIssue("teacher_model.attn_implementation", _for_teacher(why)))
    return issues


def _for_teacher(message: str) -> str:
    """A message of the core's context parallelism, which names the student's key, naming the teacher's."""
    return message.replace("distributed.cp_size", "teacher_distributed.cp_size")


def pp_teacher_issues(hf_config: Any, pp: int, section: dict[str, Any] | None, cfg: Any) -> list[ConfigIssue]:
    """What ``teacher_distributed.pipeline`` asks that the teacher's forward-only pipeline cannot do, and whether
    the teacher (``hf_config``, where readable) cuts into ``pp`` stages for the run's micro-batches."""
    from automodel.training.plan import batch_layout

    if section is not None and not isinstance(section, dict):
        return [ConfigIssue(PIPELINE_KEY, f"expected a mapping of pipeline settings, found {section!r}")]
    issues = section_issues(section, PIPELINE_KEY)
    for name in ("pp_seq_len", "dtype"):
        if (section or {}).get(name) is not None:
            issues.append(ConfigIssue(f"{PIPELINE_KEY}.{name}", f"{section[name]!r}: static stage shapes save the "
                                      "training pipeline's shape-finding backward pass; the teacher's pipeline runs "
                                      "no backward and finds each batch's shapes with its forward; remove it"))
    if issues:
        return issues
    settings = PipelineSettings.from_section(section)
    if settings.schedule in SCHEDULES and settings.schedule not in FORWARD_SCHEDULES:
        return [ConfigIssue(f"{PIPELINE_KEY}.pp_schedule", f"'{settings.pp_schedule}' runs several stages per rank, "
                            "which saves a training step's pipeline bubbles between forward and backward; the "
                            "teacher's pipeline runs forwards only: use gpipe or 1f1b")]
    if hf_config is None:
        return []
    return pp_issues(hf_config, pp, settings, batch_layout(cfg)[0].micro_batch_size, "teacher_distributed")


def student_logits(logits: torch.Tensor, batch: dict[str, torch.Tensor], offset: int = 1) -> torch.Tensor:
    """Of the whole batch's ``[rows, sequence, vocab]`` logits, the rows a student's ``next_token_logits`` gives:
    the label positions' where the batch names them, else every position but each row's last ``offset`` (the
    recipe's ``label_offset``: 0 where the labels are the next tokens already)."""
    flat = logits[:, :logits.shape[1] - offset] if LABEL_POSITIONS not in batch else logits
    flat = flat.reshape(-1, logits.shape[-1])
    return flat.index_select(0, batch[LABEL_POSITIONS]) if LABEL_POSITIONS in batch else flat


class ContextParallelTeacher:
    """The teacher's logits of a micro-batch computed by the ranks of ``cp_mesh``, each on its part of the
    sequences (every rank calls it with the same batch; every rank gets the logits)."""

    label_offset = 1  # the recipe's (see student_logits)

    def __init__(self, teacher: nn.Module, cp_mesh: DeviceMesh, shard: bool):
        self.teacher, self.cp_mesh = teacher, cp_mesh
        if (why := built_attention_issue(getattr(teacher, "config", None))) is not None:
            raise AutomodelError(f"teacher_model.attn_implementation: {_for_teacher(why)}")
        causal_attention_without_mask(teacher)  # eager attention runs as SDPA in the region
        if shard:
            from automodel.training.parallel.fsdp import apply_fsdp2

            apply_fsdp2(teacher, cp_mesh)

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        input_ids, length = batch["input_ids"], batch["input_ids"].shape[1]
        extra = -length % (2 * self.cp_mesh.size())
        part = ContextParallelBatch.from_labels(_pad(input_ids, extra, 0), _pad(batch["labels"], extra, -100),
                                                _positions(batch.get("position_ids"), extra),
                                                _pad(batch.get("attention_mask"), extra, 0))
        with context_parallel_region(self.cp_mesh, part, "all_gather"):
            logits = self.teacher(**part.model_inputs()).logits
        return student_logits(self._whole(logits, length + extra)[:, :length], batch, self.label_offset)

    def _whole(self, logits: torch.Tensor, length: int) -> torch.Tensor:
        """Every rank's part of the logits, put back in sequence order (the region's split, undone)."""
        from automodel.training.parallel.all_gather_attention import part_indices

        size, group = self.cp_mesh.size(), self.cp_mesh.get_group()
        parts = [torch.empty_like(logits) for _ in range(size)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        order = torch.cat([part_indices(length, size, rank) for rank in range(size)]).to(logits.device)
        whole = torch.empty(logits.shape[0], length, logits.shape[2], dtype=logits.dtype, device=logits.device)
        whole[:, order] = torch.cat(parts, dim=1)
        return whole


def _pad(tensor: torch.Tensor | None, extra: int, value: int) -> torch.Tensor | None:
    return tensor if tensor is None or not extra else torch.nn.functional.pad(tensor, (0, extra), value=value)


def _positions(positions: torch.Tensor | None, extra: int) -> torch.Tensor | None:
    """The batch's position ids continued over ``extra`` padding positions (None: the rows' own 0 .. length - 1)."""
    if positions is None or not extra:
        return positions
    steps = torch.arange(1, extra + 1, device=positions.device, dtype=positions.dtype)
    return torch.cat([positions, positions[..., -1:] + steps], dim=-1)


class PipelineTeacher:
    """The teacher cut into the stages of ``pp_mesh`` (this rank's stage kept) and run forward by torch's schedule;
    every rank calls it with the same batch; the last stage's rank gets the logits (the others None)."""

    label_offset = 1  # the recipe's (see student_logits)

    def __init__(self, teacher: nn.Module, pp_mesh: DeviceMesh, device: torch.device, settings: PipelineSettings):
        from automodel.training.parallel.pipeline_stages import split_model
        from automodel.training.parallel.pipeline_tied import untie_head

        untie_head(teacher)  # frozen: the last stage's copy of the tied head stays the first stage's embedding
        self.stage = split_model(teacher, pp_mesh.get_local_rank(), pp_mesh.size())[0].to(device)
        self.stage.release_whole_model()
        self.pp_mesh, self.device, self.settings = pp_mesh, device, settings
        self._schedules: dict[tuple[int, ...], Any] = {}

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        from automodel.training.pipeline_steps import stage_kwargs

        input_ids = batch["input_ids"]
        with torch.no_grad():
            logits = self._schedule(input_ids.shape).step(input_ids, **stage_kwargs(batch, 0))
        return student_logits(logits, batch, self.label_offset) if self.stage.is_last else None

    def _schedule(self, shape: torch.Size) -> Any:
        """The schedule for batches of ``shape`` (torch's stages size their buffers from the first batch they run,
        so each shape gets stages of its own; those of the last :data:`KEPT_SHAPES` shapes are kept)."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        key = tuple(shape)
        if key not in self._schedules:
            if len(self._schedules) >= KEPT_SHAPES:
                del self._schedules[next(iter(self._schedules))]
            rows, size, pp = shape[0], self.settings.pp_microbatch_size, self.pp_mesh.size()
            name = self.settings.schedule
            if rows % size or (name == "1f1b" and rows // size < pp):
                name, size = "gpipe", 1
            run = PipelineStage(self.stage, self.stage.index, self.stage.num_stages, self.device,
                                group=self.pp_mesh.get_group())
            self._schedules[key] = get_schedule_class(SCHEDULES[name])(run, rows // size, loss_fn=None)
        return self._schedules[key]
