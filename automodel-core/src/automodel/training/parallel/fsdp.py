"""FSDP2 over the data-parallel mesh: one unit per transformer block, then the root."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from automodel.training.parallel.blocks import transformer_blocks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from automodel.training.parallel.precision import Precision


def apply_fsdp2(model: nn.Module, dp_mesh: DeviceMesh, precision: Precision | None = None,
                prefetch: tuple[int, int] | None = None, reshard_after_forward: bool | None = None,
                ignored: set[nn.Parameter] | None = None) -> int:
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
    parallelism, which syncs their gradients itself).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = precision.fsdp_policy() if precision is not None else MixedPrecisionPolicy()
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        reshard = index < len(blocks) - 1 if reshard_after_forward is None else reshard_after_forward
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard, ignored_params=ignored)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, ignored_params=ignored)
    if prefetch is not None:
        set_prefetch(blocks, *prefetch)
    return len(blocks)


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
