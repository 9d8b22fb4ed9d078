"""FSDP2 over the data-parallel mesh: one unit per transformer block, then the root."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from automodel.training.parallel.blocks import transformer_blocks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from automodel.training.parallel.precision import Precision


def apply_fsdp2(model: nn.Module, dp_mesh: DeviceMesh, precision: Precision | None = None) -> int:
    """Shard ``model`` in place (on the meta device or materialised) and return how many blocks became units.

    ``dp_mesh`` is 1-D (FSDP: ``Shard(0)``) or 2-D ``(dp_replicate, dp_shard)`` (HSDP: ``(Replicate(), Shard(0))``);
    see :func:`automodel.training.parallel.mesh.data_parallel_mesh`. Each block frees its gathered parameters
    after forward, so only one block's full parameters live at a time, except the last block, whose parameters
    backward needs first; the root (embeddings, final norm, head) stays gathered between forward and backward,
    FSDP2's default for the root. Apply activation checkpointing and LoRA before this.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = precision.fsdp_policy() if precision is not None else MixedPrecisionPolicy()
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=index < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return len(blocks)
