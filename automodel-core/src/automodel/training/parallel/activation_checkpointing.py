"""Activation checkpointing: each transformer block's activations are recomputed in backward instead of kept.

torch's ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``) wraps each block, chosen over the HF
model's ``gradient_checkpointing_enable`` because it works for any model with repeated blocks (the diffusion,
retrieval and VLM domains' models too), it does not depend on a transformers version's layer classes, and the
wrapper sits outside FSDP2's unit, the composition torch documents: apply it *before* ``fully_shard``. The wrapper
keeps ``state_dict()`` names unchanged; :func:`automodel.training.parallel.blocks.clean_name` strips its prefix from
``named_parameters()`` names.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from automodel.training.parallel.blocks import transformer_blocks


def apply_activation_checkpointing(model: nn.Module, save_routing: bool = False, skip: Collection[nn.Module] = ()
                                   ) -> int:
    """Wrap every transformer block of ``model`` in place (not searched for in the ``skip`` modules: a
    vision-language model's towers); returns how many (0: the model has none).

    ``save_routing`` (upstream's ``moe.ignore_router_for_ac``): the outputs of every ``topk`` in a block (a MoE
    router's choice of experts) are kept from the forward and reused by the recomputation (torch's selective
    checkpointing), so backward sees the routing the forward used instead of computing it again."""
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
    kwargs = {"context_fn": _save_topk} if save_routing else {}
    wrap_modules(model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, CheckpointImpl.NO_REENTRANT, **kwargs),
                 check_fn=lambda m: id(m) in blocks)
    return len(blocks)


def _save_topk() -> tuple:
    """Selective checkpointing contexts that keep ``topk``'s outputs and recompute everything else."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.topk.default else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
