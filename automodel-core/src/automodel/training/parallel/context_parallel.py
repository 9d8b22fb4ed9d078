"""Context parallelism over the mesh's ``cp`` dimension: each rank of a ``cp`` group holds a part of every sequence.

torch's ``context_parallel`` (``torch.distributed.tensor.experimental``) shards the batch's tensors along the
sequence in place (load-balanced for causal attention: rank ``r`` of ``n`` holds chunks ``r`` and ``2n - 1 - r`` of
``2n``) and replaces SDPA by ring attention built on SDPA's flash / memory-efficient kernels, which run on CUDA
GPUs only: :func:`cp_issues` refuses anything else at validation.

Next-token labels are shifted before the split (:func:`next_token_targets`): position ``i`` carries the target
``labels[i + 1]``, so a rank's positions keep their targets, wherever the next token went. The position ids go
with the tokens (rotary embeddings need the true positions), and the attention runs causal without a mask
(:func:`causal_attention_without_mask`: a mask built from the split positions would be wrong); attention that is not
causal (a vision encoder's, over whole images that every rank holds) keeps SDPA's own kernel. The loss is the
engine's: summed over the rank's targets, divided by the step's label tokens (counted before the split, over the
data-parallel ranks only: the ``cp`` ranks of a batch share it); FSDP2 shards over ``dp_shard x cp``
(:func:`fsdp_mesh`), so its gradient average runs over ``dp x cp`` ranks, and the scale is ``dp * cp / tokens``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.loss import IGNORE_INDEX
from automodel.training.parallel.blocks import attention_modules
from automodel.training.parallel.mesh import data_parallel_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from automodel.training.parallel.mesh import MeshLayout

SEQUENCE_DIM = 1


def cp_issues(device: torch.device | str, cp_size: int, attn_implementation: str | None = None,
              section: str = "distributed") -> list[ConfigIssue]:
    """Whether ``cp_size`` can run on ``device``; each problem says what would run it."""
    if cp_size == 1:
        return []
    device = torch.device(device)
    if device.type != "cuda":
        return [ConfigIssue(f"{section}.cp_size", f"{cp_size}: context parallelism runs torch's ring attention "
                            "(torch.distributed.tensor.experimental.context_parallel), which needs SDPA's flash or "
                            f"memory-efficient attention kernels on CUDA GPUs; this run is on {device.type}. Run it "
                            "on NVIDIA GPUs (one process per GPU, nccl) or set cp_size: 1")]
    issues = []
    if not (torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()):
        issues.append(ConfigIssue(f"{section}.cp_size", f"{cp_size}: SDPA's flash and memory-efficient kernels are "
                                  "both disabled (torch.backends.cuda); context parallelism needs one of them"))
    if attn_implementation not in (None, "sdpa"):
        issues.append(ConfigIssue("model.attn_implementation", f"'{attn_implementation}': context parallelism "
                                  "replaces SDPA's attention; use sdpa (or set distributed.cp_size: 1)"))
    return issues


def sliding_window_issue(config: Any) -> str | None:
    """Why ring attention (one causal attention over the whole split sequence) is not the model's attention, for a
    model with sliding-window layers (None: it has none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "sliding_attention" not in (getattr(text, "layer_types", None) or ()):
        return None
    return (f"the model's sliding-window layers see only the last {getattr(text, 'sliding_window', '?')} tokens, but "
            "context parallelism runs one causal attention over the whole split sequence (torch's ring attention), "
            "which would train another attention; set cp_size: 1")


def fsdp_mesh(mesh: DeviceMesh, layout: MeshLayout) -> DeviceMesh:
    """The mesh FSDP2 shards over: :func:`data_parallel_mesh`, its ``dp_shard`` joined with ``cp`` when cp > 1
    (the ``cp`` ranks of a batch hold partial gradients, which FSDP's reduction must include)."""
    if layout.cp == 1:
        return data_parallel_mesh(mesh, layout)
    joined = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard_cp"] if layout.dp_replicate > 1 else joined


def next_token_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels`` shifted left along the sequence: position ``i`` holds the label of token ``i + 1`` (the last
    position ``ignore_index``), so the targets can be split over ranks with the tokens."""
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    return targets


@dataclass
class ContextParallelBatch:
    """A micro-batch in the form context parallelism splits: token ids, their positions, next-token targets."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def from_labels(cls, input_ids: torch.Tensor, labels: torch.Tensor,
                    position_ids: torch.Tensor | None = None) -> ContextParallelBatch:
        """The batch's own ``position_ids`` where it has them, else each row's ``0 .. length - 1``; the tensors
        are new ones (the region splits them in place, the collated batch stays whole)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[SEQUENCE_DIM], device=input_ids.device).expand_as(input_ids)
        return cls(input_ids.clone(), position_ids.clone().contiguous(), next_token_targets(labels))

    def label_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    def split_in_place(self) -> list[torch.Tensor]:
        """The tensors the region splits along the sequence, in place (each ``[batch, sequence]``)."""
        return [self.input_ids, self.position_ids, self.targets]

    def model_inputs(self) -> dict[str, Any]:
        """The model's keyword arguments for this rank's part."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}


def split_sequence(tensor: torch.Tensor, cp_mesh: DeviceMesh, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """This rank's part of ``tensor`` along ``dim``, laid out as the region splits its tensors (chunks ``r`` and
    ``2n - 1 - r`` of ``2n``), out of place and differentiable: for tensors computed inside the forward (a
    vision-language model's merged embeddings, its multi-axis rope positions)."""
    chunks = tensor.chunk(2 * cp_mesh.size(), dim=dim)
    rank = cp_mesh.get_local_rank()
    return torch.cat([chunks[rank], chunks[len(chunks) - 1 - rank]], dim=dim)


@contextlib.contextmanager
def _ring_for_causal_only(plain: Any) -> Iterator[None]:
    """Within the block only causal SDPA calls run as ring attention; the others (a vision encoder's bidirectional
    attention over whole images, which every rank holds) keep ``plain``, SDPA as it was before the region."""
    ring = F.scaled_dot_product_attention

    def route(*args: Any, **kwargs: Any) -> torch.Tensor:
        causal = kwargs.get("is_causal", len(args) > 5 and args[5])  # (query, key, value, mask, dropout, is_causal)
        return (ring if causal else plain)(*args, **kwargs)

    F.scaled_dot_product_attention = route
    try:
        yield
    finally:
        F.scaled_dot_product_attention = ring  # torch's context_parallel restores its own replacement


@contextlib.contextmanager
def context_parallel_region(cp_mesh: DeviceMesh, batch: ContextParallelBatch) -> Iterator[None]:
    """Run the micro-batch's forward *and* backward inside: the batch's tensors hold this rank's part of the
    sequence (in place; not restored) and causal SDPA runs as ring attention over ``cp_mesh``."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chunks = 2 * cp_mesh.size()
    buffers = batch.split_in_place()
    length = buffers[0].shape[SEQUENCE_DIM]
    if length % chunks:
        raise AutomodelError(f"context parallelism over {cp_mesh.size()} ranks splits each sequence into {chunks} "
                             f"chunks, but this batch's sequences have {length} positions; pad them to a multiple "
                             f"of {chunks}")
    plain = F.scaled_dot_product_attention
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]), \
            context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[SEQUENCE_DIM] * len(buffers),
                             no_restore_buffers=set(buffers)), _ring_for_causal_only(plain):
        yield


def causal_attention_without_mask(model: nn.Module, skip: Collection[nn.Module] = ()) -> int:
    """Make every attention module of ``model``'s transformer blocks run causal without a mask (the model's mask,
    built from the split position ids, would not match ring attention); returns how many were hooked. The modules
    are found below wrappers (activation checkpointing) too; those inside ``skip`` (a vision-language model's
    towers, which see whole images) are left as they are."""
    def drop_mask(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return args, {**kwargs, "attention_mask": None}

    modules = attention_modules(model, skip)
    for module in modules:
        module.register_forward_pre_hook(drop_mask, with_kwargs=True)
    hooked = len(modules)
    if not hooked:
        raise AutomodelError(f"context parallelism found no attention module in the layers of "
                             f"'{type(model).__name__}'")
    return hooked
