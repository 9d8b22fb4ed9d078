"""Activation checkpointing: each transformer block's activations are recomputed in backward instead of kept.

torch's ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``) wraps each block, chosen over the HF
model's ``gradient_checkpointing_enable`` because it works for any model with repeated blocks (the diffusion,
retrieval and VLM domains' models too), it does not depend on a transformers version's layer classes, and the
wrapper sits outside FSDP2's unit, the composition torch documents: apply it *before* ``fully_shard``. The wrapper
keeps ``state_dict()`` names unchanged; :func:`automodel.training.parallel.blocks.clean_name` strips its prefix from
``named_parameters()`` names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator

from torch import nn

from automodel.training.parallel.blocks import transformer_blocks


def apply_activation_checkpointing(model: nn.Module, save_routing: bool = False, skip: Collection[nn.Module] = (),
                                   selective: bool = False, split_region: bool = False) -> int:
    """Wrap every transformer block of ``model`` in place (not searched for in the ``skip`` modules: a
    vision-language model's towers); returns how many (0: the model has none).

    ``save_routing`` (upstream's ``moe.ignore_router_for_ac``): the outputs of every ``topk`` in a block (a MoE
    router's choice of experts) are kept from the forward and reused by the recomputation (torch's selective
    checkpointing), so backward sees the routing the forward used instead of computing it again.

    ``selective`` (upstream's ``activation_checkpointing: selective``, TorchTitan's op-level policy): the outputs
    of the costly ops (attention, every other plain matmul, the batched matmuls, ``topk``) are kept and only the
    cheap ones (norms, activations, element-wise ops) recomputed: less memory saved than full checkpointing, and
    less compute spent.

    ``split_region`` (pipeline with context parallelism): a block's recomputation in backward enters again the
    context-parallel region its forward ran in (``SplitRegion.recomputation``), with the micro-batch's attention;
    the schedule runs the backward after the stage's forward left it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as wrap_modules,
    )

    blocks = {id(block) for block in transformer_blocks(model, skip)}
    if not blocks:
        return 0
    context = _selective if selective else _save_topk if save_routing else None
    if split_region:
        context = _in_split_region(context)
    kwargs = {"context_fn": context} if context is not None else {}
    wrap_modules(model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, CheckpointImpl.NO_REENTRANT, **kwargs),
                 check_fn=lambda m: id(m) in blocks)
    return len(blocks)


def _in_split_region(policy: Callable[[], tuple] | None) -> Callable[[], tuple]:
    """``policy``'s forward and recomputation contexts (none: plain checkpointing), the recomputation also in the
    context-parallel region of the forward."""
    from automodel.training.parallel.all_gather_attention import SplitRegion

    def contexts() -> tuple:
        forward, recompute = policy() if policy is not None else (contextlib.nullcontext(), contextlib.nullcontext())
        return forward, _within(recompute, SplitRegion.recomputation())

    return contexts


@contextlib.contextmanager
def _within(outer: contextlib.AbstractContextManager, inner: contextlib.AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


def _save_topk() -> tuple:
    """Selective checkpointing contexts that keep ``topk``'s outputs and recompute everything else."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.topk.default else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _selective() -> tuple:
    """One block's forward and recomputation contexts of the ``selective`` policy (a fresh count per call: torch
    asks for them once per checkpointed forward). The recomputation sees the same ops in the same order as the
    forward, so the every-other count makes the same choices in both."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    always, alternating = _selective_ops()
    seen = {"forward": 0, "recompute": 0}

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        if op in alternating:
            pass_name = "recompute" if ctx.is_recompute else "forward"
            seen[pass_name] += 1
            return CheckpointPolicy.MUST_SAVE if seen[pass_name] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in always else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _selective_ops() -> tuple[frozenset, frozenset]:
    """(ops always kept, plain matmuls kept every other time) of the ``selective`` policy; ops a torch build lacks
    are left out."""
    import torch

    def existing(*names: str) -> frozenset:
        found = (getattr(getattr(torch.ops.aten, name, None), "default", None) for name in names)
        return frozenset(op for op in found if op is not None)

    always = existing("addmm", "bmm", "_scaled_mm", "topk", "max", "scaled_dot_product_attention",
                      "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                      "_flex_attention")
    return always, existing("mm", "linear", "_grouped_mm")
