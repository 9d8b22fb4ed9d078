"""``distributed.multimodal.vision.frame_sharding``: under context parallelism each ``cp`` rank runs the vision
tower on its share of the batch's images / video frames instead of all of them.

A Qwen-VL vision tower (``visual(pixel_values, grid_thw=...)``) attends within each frame only: its attention is
cut per frame by ``grid_thw``'s ``(t, h, w)`` rows and its positions are spatial, repeated over ``t``. So the tower
on the whole batch equals, frame by frame, the tower on any contiguous run of frames. While :meth:`FrameSharding.
active`, a pre-hook on the tower hands it this rank's run of frames (its pixel patch rows and its own grid rows;
the runs balanced by a cost ``patches x (patches + cost_alpha)`` per frame, as upstream's) and a hook after it
all-gathers the merged features (and Qwen3-VL's deepstack features) back into the batch's order, with autograd:
backward all-reduces the features' gradient and hands each rank its own frames' part. Each rank's tower gradient
is then that of the whole ``cp`` group's loss through its frames, which sums over the group, as FSDP2's reduction
over ``dp x cp`` does, to the gradient the unsharded run gives (each rank: its part of the loss through all
frames). The merge and the sequence split (:mod:`automodel_vlm.context_parallel`) run as without it.

Below ``min_tokens`` merged tokens and ``min_frames`` frames the tower runs on the whole batch (the gather would
cost more than it saves). A rank left without a frame (fewer frames than ranks) runs one zero frame whose output
is dropped, so every rank runs the tower (FSDP2's per-block units gather alike); a rank with fewer than
``min_local_patch_rows`` patch rows runs zero frames after its own to reach them (upstream's floor against
shape-dependent low-precision kernels), their outputs dropped too.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.multimodal_section import frame_sharding
from automodel_vlm.parts import base_model, find_part

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# model types whose vision tower attends within each frame of grid_thw (transformers' Qwen-VL families)
FRAME_SHARDED_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
DEFAULTS = {"min_tokens": 2048, "min_frames": 32, "min_local_patch_rows": 96, "cost_alpha": "auto"}


def frame_sharding_issue(config: Any) -> str | None:
    """Why this model's vision tower cannot be split by frames (None: it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type in FRAME_SHARDED_MODELS:
        return None
    return (f"a {model_type} model: frame sharding splits the frames of a Qwen-VL vision tower (model types "
            f"{', '.join(FRAME_SHARDED_MODELS)}), whose attention stays within each frame of its grid_thw; set "
            "enabled: false (every cp rank then runs the whole vision tower)")


class _GatheredFeatures(torch.autograd.Function):
    """Every ``cp`` rank's ``[counts[rank], ...]`` features, concatenated in rank order."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
        ctx.group, ctx.counts, ctx.rank = group, counts, dist.get_rank(group)
        padded = part.new_zeros((max(counts), *part.shape[1:]))  # all_gather takes equal shapes
        padded[:part.shape[0]] = part
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([gathered[:count] for gathered, count in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's part of the loss read every rank's features
        start = sum(ctx.counts[:ctx.rank])
        return grad[start:start + ctx.counts[ctx.rank]], None, None


def balanced_cuts(costs: list[int], size: int) -> list[int]:
    """Cut points ``cuts`` (``[0, ..., len(costs)]``) of ``size`` contiguous runs (rank ``r``'s: ``costs[cuts[r]:
    cuts[r + 1]]``) of about equal total cost, each with at least one item where there are ``size`` or more."""
    middles = [end - cost / 2 for end, cost in zip(itertools.accumulate(costs), costs, strict=True)]
    cuts = [0]
    for rank in range(1, size):
        nearest = bisect.bisect_right(middles, sum(costs) * rank / size)  # items whose middle is before the mark
        low = min(cuts[-1] + 1, len(costs))  # at least one item for the rank just closed
        cuts.append(max(low, min(nearest, len(costs) - (size - rank))))  # and one for each rank after it
    return [*cuts, len(costs)]


@dataclass
class _Plan:
    """This call's split: each rank's merged-token count and the rows of this rank's output to keep."""

    counts: list[int]
    keep: int


class FrameSharding:
    """Hooks on the vision tower that, while :meth:`active`, split its frames over ``cp_mesh`` (module docstring);
    ``settings``: the ``frame_sharding`` section (missing keys at upstream's defaults)."""

    def __init__(self, tower: torch.nn.Module, cp_mesh: DeviceMesh, settings: dict[str, Any]):
        if not isinstance(getattr(tower, "spatial_merge_size", None), int):
            raise AutomodelError("distributed.multimodal.vision.frame_sharding: the model's vision tower "
                                 f"'{type(tower).__name__}' has no spatial_merge_size: it is not a Qwen-VL tower "
                                 "whose frames can be split; set enabled: false")
        self.group, self.size, self.rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
        self.settings = {**DEFAULTS, **settings}
        self.merge = tower.spatial_merge_size
        alpha = self.settings["cost_alpha"]
        config = getattr(tower, "config", None)
        width = getattr(config, "embed_dim", None) or getattr(config, "hidden_size", 0)  # Qwen2-VL: embed_dim
        self.alpha = 3 * width if alpha in (None, "auto") else alpha
        self._on, self._plan = False, None
        tower.register_forward_pre_hook(self._split, with_kwargs=True)
        tower.register_forward_hook(self._gather, with_kwargs=True)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the vision tower runs on this rank's frames."""
        self._on = True
        try:
            yield
        finally:
            self._on, self._plan = False, None

    def _split(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        grid = kwargs.get("grid_thw")
        if not self._on or grid is None or not args:
            return None
        extra = sorted(k for k, v in kwargs.items() if k != "grid_thw" and isinstance(v, torch.Tensor))
        if extra or len(args) > 1:
            raise AutomodelError(f"distributed.multimodal.vision.frame_sharding: the vision tower was called with "
                                 f"{', '.join(extra) or 'more positional inputs'} laid out over all frames, which "
                                 "a split by frames cannot follow; set enabled: false")
        frames = [(entry, h, w) for entry, (t, h, w) in enumerate(grid.tolist()) for _ in range(t)]
        tokens = [h * w // self.merge ** 2 for _, h, w in frames]
        small = sum(tokens) < self.settings["min_tokens"] and len(frames) < self.settings["min_frames"]
        if small or not frames:
            return None  # the whole batch on every rank
        cuts = balanced_cuts([h * w * (h * w + self.alpha) for _, h, w in frames], self.size)
        mine = frames[cuts[self.rank]:cuts[self.rank + 1]]
        rows = [h * w for _, h, w in frames]
        start = sum(rows[:cuts[self.rank]])
        pixels = args[0][start:start + sum(rows[cuts[self.rank]:cuts[self.rank + 1]])]
        grid_rows = _grid_rows(mine)
        padding = self._padding(mine)
        if padding is not None:
            grid_rows.append(padding)
            pixels = torch.cat([pixels, pixels.new_zeros(padding[0] * padding[1] * padding[2], pixels.shape[1])])
        self._plan = _Plan([sum(tokens[cuts[r]:cuts[r + 1]]) for r in range(self.size)],
                           sum(tokens[cuts[self.rank]:cuts[self.rank + 1]]))
        return (pixels,), {**kwargs, "grid_thw": torch.tensor(grid_rows, dtype=grid.dtype, device=grid.device)}

    def _padding(self, mine: list[tuple[int, int, int]]) -> list[int] | None:
        """The zero frames (a grid row) run after this rank's own: one minimal frame where it has none, else
        frames like its last up to ``min_local_patch_rows`` patch rows (None: none needed)."""
        if not mine:
            return [1, self.merge, self.merge]
        rows, (_, h, w) = sum(h * w for _, h, w in mine), mine[-1]
        missing = self.settings["min_local_patch_rows"] - rows
        return [-(-missing // (h * w)), h, w] if missing > 0 else None

    def _gather(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        plan, self._plan = self._plan, None
        if plan is None:
            return None
        if isinstance(output, torch.Tensor):
            return self._gathered(output, plan)
        output.pooler_output = self._gathered(output.pooler_output, plan)
        if getattr(output, "deepstack_features", None) is not None:  # Qwen3-VL: features of inner layers
            output.deepstack_features = [self._gathered(part, plan) for part in output.deepstack_features]
        output.last_hidden_state = None  # this rank's patches only: nothing downstream may read it
        return output

    def _gathered(self, features: torch.Tensor, plan: _Plan) -> torch.Tensor:
        return _GatheredFeatures.apply(features[:plan.keep], plan.counts, self.group)


def _grid_rows(frames: list[tuple[int, int, int]]) -> list[list[int]]:
    """``(t, h, w)`` rows of consecutive frames: one row per run of the same image or video."""
    rows: list[list[int]] = []
    last = None
    for entry, h, w in frames:
        if entry == last:
            rows[-1][0] += 1
        else:
            rows.append([1, h, w])
        last = entry
    return rows


def frame_sharding_issues(cfg: Any, config: Any) -> list[ConfigIssue]:
    """Validation's refusal of frame sharding (``cp_size > 1``) with pipeline parallelism, and for a model whose
    config it reads (``config``; None: it cannot) and whose vision tower is not a Qwen-VL one."""
    if frame_sharding(cfg) is None:
        return []
    issues = []
    if cfg.distributed.pp_size > 1:
        issues.append(ConfigIssue("distributed.multimodal.vision.frame_sharding.enabled", f"true with pp_size "
                                  f"{cfg.distributed.pp_size}: frame sharding splits the vision tower's frames in the "
                                  "unpipelined forward; the pipeline's first stage runs the whole tower on every cp "
                                  "rank; set enabled: false or pp_size: 1"))
    if config is not None and (issue := frame_sharding_issue(config)) is not None:
        issues.append(ConfigIssue("distributed.multimodal.vision.frame_sharding.enabled", f"true: {issue}"))
    return issues


def attach_frame_sharding(model: torch.nn.Module, cfg: Any, cp_mesh: DeviceMesh) -> FrameSharding | None:
    """The vision tower's frame sharding where ``cfg`` enables it (None: it does not); ``cp_size > 1``."""
    settings = frame_sharding(cfg)
    if settings is None:
        return None
    if (issue := frame_sharding_issue(getattr(base_model(model), "config", None))) is not None:
        raise AutomodelError(f"distributed.multimodal.vision.frame_sharding.enabled: true: {issue}")
    tower = find_part(model, "vision_tower")
    if tower is None:
        raise AutomodelError("distributed.multimodal.vision.frame_sharding: the model has no vision tower (a "
                             "module named visual, vision_tower, ...) to split; set enabled: false")
    return FrameSharding(tower[1], cp_mesh, settings)
