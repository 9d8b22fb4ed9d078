"""FSDP2 over the data-parallel mesh: one unit per transformer block, then the root."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from automodel.training.parallel.blocks import transformer_blocks
from automodel.training.parallel.multimodal_fsdp import MultimodalPlacement

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from automodel.training.parallel.precision import Precision


def apply_fsdp2(model: nn.Module, dp_mesh: DeviceMesh, precision: Precision | None = None,
                prefetch: tuple[int, int] | None = None, reshard_after_forward: bool | None = None,
                ignored: set[nn.Parameter] | None = None, own_dtype: Mapping[nn.Module, torch.dtype] | None = None,
                outer_root: bool = True, multimodal: MultimodalPlacement | None = None, offload: Any = None) -> int:
    """Shard ``model`` in place (on the meta device or materialised) and return how many blocks became units.

    ``dp_mesh`` is 1-D (FSDP: ``Shard(0)``) or 2-D ``(dp_replicate, dp_shard)`` (HSDP: ``(Replicate(), Shard(0))``);
    see :func:`automodel.training.parallel.mesh.data_parallel_mesh`. Each block frees its gathered parameters
    after forward, so only one block's full parameters live at a time, except the last block, whose parameters
    backward needs first; the root (embeddings, final norm, head) stays gathered between forward and backward,
    FSDP2's default for the root. Apply activation checkpointing and LoRA before this.

    ``reshard_after_forward`` true / false frees every block's / no block's parameters after forward instead.
    ``prefetch`` (forward depth, backward depth): each block then gathers that many following blocks ahead in
    forward (preceding ones in backward) instead of FSDP2's implicit one-block prefetch (upstream's
    ``enable_fsdp2_prefetch``). ``ignored``: parameters FSDP2 leaves as they are (experts split by expert
    parallelism, which syncs their gradients itself). ``own_dtype``: modules each made their own unit (before the
    blocks that hold them) that keeps its parameters, gradient reduction and output in its dtype whatever
    ``precision`` says, its input cast to it: the output head in float32 (upstream's ``moe.lm_head_precision:
    float32``; it must not share its weight with the embeddings, checked by the caller) and the routers of
    ``model.backend.gate_precision`` (:mod:`automodel.gate_precision`). ``outer_root`` false (upstream's
    ``moe.wrap_outer_model: false``): the causal LM's inner model (``base_model``) is the root unit and the output
    head a unit of its own, and the outer wrapper is left unsharded (it holds no parameters of its own; see
    :func:`inner_root_issue`). ``multimodal``: where the vision / audio towers and projectors go
    (:mod:`.multimodal_fsdp`): never searched for the blocks, their units made first, their ignored parameters
    left out of the root. ``offload``: FSDP2's offload policy for every unit (:mod:`.offload`; None: none).
    """
    from functools import partial

    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    shard = partial(fully_shard, offload_policy=offload if offload is not None else OffloadPolicy())
    policy = precision.fsdp_policy() if precision is not None else MixedPrecisionPolicy()
    multimodal = multimodal or MultimodalPlacement()
    blocks = transformer_blocks(model, skip=multimodal.modules.values())
    reshard = True if reshard_after_forward is None else reshard_after_forward
    own_dtype = own_dtype or {}
    for module, dtype in own_dtype.items():
        shard(module, mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(dtype, dtype, dtype), reshard_after_forward=reshard)
    for unit in multimodal.units:
        shard(unit, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    root_ignored = (ignored or set()) | multimodal.ignored or None
    for index, block in enumerate(blocks):
        block_reshard = index < len(blocks) - 1 if reshard_after_forward is None else reshard_after_forward
        shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=block_reshard, ignored_params=ignored)
    if outer_root:
        shard(model, mesh=dp_mesh, mp_policy=policy, ignored_params=root_ignored)
    else:
        head = model.get_output_embeddings()
        if head not in own_dtype:
            shard(head, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
        shard(model.base_model, mesh=dp_mesh, mp_policy=policy, ignored_params=root_ignored)
    if prefetch is not None:
        set_prefetch(blocks, *prefetch)
    return len(blocks)


def kept_dtype_modules(model: nn.Module, ignored: set[nn.Parameter] | None = None) -> dict[nn.Module, torch.dtype]:
    """The modules holding parameters of their own in a dtype other than the model's (transformers'
    ``_keep_in_fp32_modules``: ERNIE 4.5's router weight and score-correction bias stay float32 in a bfloat16
    model), each with that dtype: FSDP2 takes one dtype per unit, so each becomes a unit of its own
    (``apply_fsdp2``'s ``own_dtype``) rather than a mixed block. ``ignored``: parameters FSDP2 leaves alone."""
    ignored = ignored or set()
    counts: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param not in ignored:
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    if len(counts) < 2:
        return {}
    common = max(counts, key=counts.get)
    kept = {}
    for module in reversed(list(model.modules())):  # inner modules first: FSDP2 shards a child before its parent
        own = {p.dtype for p in module.parameters(recurse=False) if p not in ignored}
        if own and common not in own:
            kept[module] = next(iter(own)) if len(own) == 1 else torch.float32
    return kept


def set_prefetch(blocks: list[nn.Module], forward_depth: int, backward_depth: int) -> None:
    """Explicit FSDP2 prefetch between sharded blocks: block i gathers blocks i+1..i+forward_depth ahead in forward
    and blocks i-1..i-backward_depth ahead in backward (backward runs the blocks in reverse)."""
    for index, block in enumerate(blocks):
        ahead = blocks[index + 1:index + 1 + forward_depth]
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        behind = blocks[max(0, index - backward_depth):index][::-1]
        if behind:
            block.set_modules_to_backward_prefetch(behind)


def inner_root_issue(model: nn.Module) -> str | None:
    """Why ``model`` cannot have its inner model as the FSDP2 root (``outer_root`` false), or None: it must be a
    causal LM wrapper whose parameters are its inner model's and an untied output head's."""
    inner = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inner is None or inner is model or head is None:
        return f"{type(model).__name__} is not an inner model wrapped with an output head"
    if head.weight is model.get_input_embeddings().weight:
        return "the output head shares its weight with the input embeddings (tie_word_embeddings)"
    covered = {id(p) for p in inner.parameters()} | {id(p) for p in head.parameters()}
    others = [name for name, p in model.named_parameters() if id(p) not in covered]
    if others:
        return f"the outer model holds parameters of its own ({others[0]})"
    return None
