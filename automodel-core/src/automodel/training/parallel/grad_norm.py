"""The gradient norm and clipping of a model split over ranks.

``torch.nn.utils.clip_grad_norm_`` needs gradients of one kind; under model parallelism they are ``DTensor``\\ s on
different meshes (FSDP2 over ``dp``, TP over ``tp``, both), plain tensors (a norm replicated over the ``tp`` ranks)
and, under pipeline parallelism, spread over the stages' ranks. :func:`clip_grad_norm_` takes each group of
gradients with one layout, computes its norm over all its shards (``full_tensor`` of the partial norm), combines
the groups, adds the other pipeline stages' share, and scales every gradient by the one clipping factor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    pp_group: Any = None, counted_elsewhere: Iterable[torch.nn.Parameter] = ()) -> torch.Tensor:
    """The whole model's gradient norm (every rank gets the same value); gradients are scaled so it is at most
    ``max_norm`` (``math.inf``: measured only). ``pp_group``: the ranks holding the other pipeline stages.
    ``counted_elsewhere``: parameters whose gradient another rank's norm counts (a tied head's copy of the
    embedding's, ``pipeline_tied``): scaled, not counted twice."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    skipped = {id(p) for p in counted_elsewhere}
    layouts: dict[Any, list[torch.nn.Parameter]] = {}
    for param in parameters:
        grad = param.grad
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        layouts.setdefault(key, []).append(param)
    norms = []
    for group in layouts.values():
        counted = [param.grad for param in group if id(param) not in skipped]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = parameters[0].device if parameters else torch.device("cpu")
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), device=device)
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, group=pp_group)
            total = total ** (1.0 / norm_type)
    if not math.isinf(max_norm):
        for group in layouts.values():  # one layout at a time: torch's foreach ops take no mixed lists
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
