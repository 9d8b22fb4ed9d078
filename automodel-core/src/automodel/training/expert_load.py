"""Expert load metrics of a mixture-of-experts model (upstream's ``moe_metrics:``): how evenly the routers spread
each training step's tokens over the experts, logged with the step (``training.jsonl`` and the metric backends).

Every fused experts module (transformers' MoE layout, :mod:`automodel.fused_experts`) counts the tokens its router
sends to each expert in a forward pre-hook, over the step's micro-batches, in training forwards only (not in
validation, nor in activation checkpointing's recomputation during backward). At the end of the step the counts are
summed over the data-parallel (and context-parallel) ranks, so the metrics describe the whole step's routing.

Per layer, with ``load`` the tokens each of its ``n`` experts received: the utilization of an expert is its load over
the fair share (``sum(load) / n``: 1 is balanced, 0 a dead expert), ``cv`` the coefficient of variation of the
loads, ``dead_expert_frac`` the fraction of experts with no token, ``expert_diversity`` ``exp(H) / n`` with ``H`` the
entropy of the routing distribution (1: every expert used alike).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from automodel.config import FieldErrors
from automodel.errors import AutomodelError
from automodel.fused_experts import expert_count, experts_modules
from automodel.training.dist import is_distributed


@dataclass
class MoEMetricsConfig:
    """``moe_metrics:``: expert load metrics of a mixture-of-experts model, logged with each training step."""

    enabled: bool = field(default=False, metadata={"help": "log the experts' load metrics with each training step"})
    mode: Literal["brief", "detailed"] = field(default="brief", metadata={"help": (
        "brief: aggregates over the layers (moe/cv_*, moe/expert_utilization_*, moe/dead_expert_frac_mean, "
        "moe/expert_diversity_*); detailed: also each layer's (moe/layer_<i>/...)")})
    top_k_experts: int = field(default=0, metadata={"help": (
        "also log the utilization of the k most and k least loaded experts (moe_expert_utilization/layer_<i>_"
        "expert_<j>); 0: none")})
    detailed_every_steps: int | None = field(default=None, metadata={"help": (
        "with mode: detailed, the per-layer metrics only on steps divisible by it (brief ones on the others); "
        "null: every step")})

    def __post_init__(self) -> None:
        errors = {}
        if isinstance(self.top_k_experts, bool) or self.top_k_experts < 0:
            errors["top_k_experts"] = f"must be an integer >= 0, found {self.top_k_experts!r}"
        if self.detailed_every_steps is not None and self.detailed_every_steps < 1:
            errors["detailed_every_steps"] = f"must be >= 1 or null, found {self.detailed_every_steps!r}"
        if errors:
            raise FieldErrors(errors)


class ExpertLoads:
    """The token counts of every experts module of a model, per training step."""

    def __init__(self, model: nn.Module, settings: MoEMetricsConfig):
        self.settings = settings
        self.modules = experts_modules(model)
        if not self.modules:
            raise AutomodelError(f"moe_metrics.enabled: {type(model).__name__} has no mixture-of-experts layer (no "
                                 "experts module with fused expert parameters, transformers' MoE layout); remove "
                                 "the section or set enabled: false")
        self.sizes = [expert_count(module) for _, module in self.modules]  # the experts each router chooses from
        self.counts: list[torch.Tensor | None] = [None] * len(self.modules)
        for index, (_, module) in enumerate(self.modules):
            module.register_forward_pre_hook(self._counter(index))

    def _counter(self, index: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def count(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not module.training or torch._C._current_graph_task_id() != -1:  # validation; recomputation
                return
            chosen = torch.bincount(args[1].detach().reshape(-1).long(), minlength=self.sizes[index]).float()
            previous = self.counts[index]
            self.counts[index] = chosen if previous is None else previous + chosen

        return count

    def step_metrics(self, step: int, groups: Iterable[Any], device: torch.device) -> dict[str, float]:
        """The step's metrics (its counts summed over ``groups``: the loop's ``data_groups()``), then the counts
        start again. Every rank calls it (the sums are collectives)."""
        loads = [count if count is not None else torch.zeros(size)
                 for count, size in zip(self.counts, self.sizes, strict=True)]
        self.counts = [None] * len(self.modules)
        flat = torch.cat([load.reshape(-1) for load in loads]).to(device, torch.float64)
        for group in groups if is_distributed() else ():
            dist.all_reduce(flat, group=group)
        detailed = self.settings.mode == "detailed" and (
            self.settings.detailed_every_steps is None or step % self.settings.detailed_every_steps == 0)
        return load_metrics(list(flat.cpu().split([load.numel() for load in loads])), detailed,
                            self.settings.top_k_experts)


def load_metrics(loads: list[torch.Tensor], detailed: bool = False, top_k: int = 0) -> dict[str, float]:
    """The metrics of one step's per-layer expert loads (token counts), layer ``i`` being ``loads[i]``."""
    layers = [_layer_stats(load) for load in loads]
    metrics: dict[str, float] = {}
    metrics.update(_aggregate("moe/cv", [layer["cv"] for layer in layers]))
    ratios = sorted(float(r) for layer in layers for r in layer["utilization"])
    metrics["moe/expert_utilization_min"] = ratios[0]
    metrics["moe/expert_utilization_median"] = statistics.median(ratios)
    metrics["moe/expert_utilization_max"] = ratios[-1]
    metrics["moe/dead_expert_frac_mean"] = statistics.fmean(layer["dead_expert_frac"] for layer in layers)
    diversities = [layer["expert_diversity"] for layer in layers]
    metrics["moe/expert_diversity_mean"] = statistics.fmean(diversities)
    metrics["moe/expert_diversity_min"] = min(diversities)
    if top_k:
        ranked = sorted(((float(r), i, j) for i, layer in enumerate(layers)  # most loaded first, ties in order
                         for j, r in enumerate(layer["utilization"])), key=lambda e: (-e[0], e[1], e[2]))
        for ratio, i, j in ranked[:top_k] + ranked[-top_k:]:
            metrics[f"moe_expert_utilization/layer_{i}_expert_{j}"] = ratio
    if detailed:
        for i, layer in enumerate(layers):
            metrics[f"moe/layer_{i}/cv"] = layer["cv"]
            metrics[f"moe/layer_{i}/utilization_max"] = float(layer["utilization"].max())
            metrics[f"moe/layer_{i}/dead_expert_frac"] = layer["dead_expert_frac"]
            metrics[f"moe/layer_{i}/expert_diversity"] = layer["expert_diversity"]
    return metrics


def _layer_stats(load: torch.Tensor) -> dict[str, Any]:
    experts, total = load.numel(), float(load.sum())
    mean = total / experts
    share = load / total if total > 0 else torch.zeros_like(load)
    entropy = -float(sum(p * math.log(p) for p in share.tolist() if p > 0))
    return {"cv": float(load.std(correction=0)) / mean if mean > 0 else 0.0,
            "utilization": load / mean if mean > 0 else torch.zeros_like(load),
            "dead_expert_frac": float((load == 0).double().mean()),
            "expert_diversity": math.exp(entropy) / experts if total > 0 else 0.0}


def _aggregate(prefix: str, values: list[float]) -> dict[str, float]:
    return {f"{prefix}_mean": statistics.fmean(values), f"{prefix}_median": statistics.median(values),
            f"{prefix}_min": min(values), f"{prefix}_max": max(values)}
