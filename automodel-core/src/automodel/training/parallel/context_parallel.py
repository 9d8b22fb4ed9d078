"""Context parallelism over the mesh's ``cp`` dimension: each rank of a ``cp`` group holds a part of every sequence.

The sequences are split load-balanced for causal attention (rank ``r`` of ``n`` holds chunks ``r`` and
``2n - 1 - r`` of ``2n``), and causal SDPA calls run as one of two attentions (``distributed.cp_attention``,
:func:`cp_attention`): torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``, built on
SDPA's flash / memory-efficient kernels, CUDA GPUs only, one causal attention over the whole split sequence), or
the all-gather attention (``all_gather_attention.py``: every rank's keys and values gathered, SDPA with an exact
mask, any device; padding anywhere in a row, packed documents, sliding windows and spans of tokens that attend
both ways included).

Next-token labels are shifted before the split (:func:`next_token_targets`): position ``i`` carries the target
``labels[i + 1]``, so a rank's positions keep their targets, wherever the next token went; labels that are
already the next tokens (a data set's ``labels_shifted``, upstream's Megatron samples) are split as they are. The
position ids go
with the tokens (rotary embeddings need the true positions), and the attention modules run without the model's
mask (:func:`causal_attention_without_mask`: a mask built from the split positions would be wrong; the region's
attention builds its own); attention that is not causal (a vision encoder's, over whole images that every rank
holds) keeps SDPA's own kernel. The loss is the engine's: summed over the rank's targets, divided by the step's
label tokens (counted before the split, over the data-parallel ranks only: the ``cp`` ranks of a batch share it);
FSDP2 shards over ``dp_shard x cp`` (:func:`fsdp_mesh`), so its gradient average runs over ``dp x cp`` ranks, and
the scale is ``dp * cp / tokens``.
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
from automodel.training.parallel.all_gather_attention import (
    SplitRegion,
    TwoWaySpans,
    all_gather_region,
    part_indices,
)
from automodel.training.parallel.blocks import attention_modules
from automodel.training.parallel.mesh import data_parallel_mesh
from automodel.training.parallel.recurrent_layers import recurrent_layer_count

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from automodel.training.parallel.mesh import MeshLayout

SEQUENCE_DIM = 1


CP_ATTENTIONS = ("auto", "ring", "all_gather")


def cp_issues(device: torch.device | str, cp_size: int, attn_implementation: str | None = None,
              section: str = "distributed", attention: str = "ring") -> list[ConfigIssue]:
    """Whether ``cp_size`` can run on ``device`` with ``attention`` (ring or all_gather); each problem says what
    would run it."""
    if cp_size == 1:
        return []
    if attention == "all_gather":
        if attn_implementation in (None, "sdpa", "eager"):  # eager runs as SDPA in the region
            return []
        return [ConfigIssue("model.attn_implementation", f"'{attn_implementation}': context parallelism's "
                            "all-gather attention replaces the model's SDPA calls (eager attention runs as SDPA "
                            "inside it); use sdpa or eager (or set distributed.cp_size: 1)")]
    device = torch.device(device)
    if device.type != "cuda":
        return [ConfigIssue(f"{section}.cp_size", f"{cp_size}: context parallelism runs torch's ring attention "
                            f"({section}.cp_attention: ring; torch.distributed.tensor.experimental.context_parallel), "
                            "which needs SDPA's flash or memory-efficient attention kernels on CUDA GPUs; this run is "
                            f"on {device.type}. Run it on NVIDIA GPUs (one process per GPU, nccl), set "
                            f"{section}.cp_attention: all_gather (any device) or set cp_size: 1")]
    issues = []
    if not (torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()):
        issues.append(ConfigIssue(f"{section}.cp_size", f"{cp_size}: SDPA's flash and memory-efficient kernels are "
                                  "both disabled (torch.backends.cuda); ring attention needs one of them"))
    if attn_implementation not in (None, "sdpa"):
        issues.append(ConfigIssue("model.attn_implementation", f"'{attn_implementation}': context parallelism "
                                  "replaces SDPA's attention; use sdpa (or set distributed.cp_size: 1)"))
    return issues


def packing_on(cfg: Any) -> bool:
    """Whether the run packs several samples per row (a ``packed_sequence`` section that is switched on)."""
    section = cfg.get("packed_sequence") if hasattr(cfg, "get") else None
    if section is None:
        return False
    return bool(getattr(section, "enabled", False) or (getattr(section, "packed_sequence_size", 0) or 0) > 0
                or (getattr(section, "pack_size", 0) or 0) > 0)


def cp_attention(cfg: Any, device: torch.device | str, model_config: Any) -> str:
    """The attention context parallelism runs: ``distributed.cp_attention`` unless ``auto``; ``auto`` is ring where
    torch's ring attention runs and computes the model's attention (CUDA with its kernels, sdpa, no packed rows,
    no sliding-window nor recurrent layers, no pipeline: its schedule runs the backward outside the stage's forward),
    else all_gather."""
    settings = cfg.distributed
    setting = getattr(settings, "cp_attention", "auto")
    if setting != "auto":
        return setting
    model = cfg.get("model") if hasattr(cfg, "get") else None
    implementation = model.get("attn_implementation") if model is not None else None
    ring = (settings.pp_size == 1 and not cp_issues(device, settings.cp_size, implementation) and not packing_on(cfg)
            and (model_config is None or (sliding_window_issue(model_config) is None
                                          and not recurrent_layer_count(model_config))))
    return "ring" if ring else "all_gather"


# recurrent model types whose configs name no layer_types
RECURRENT_MODELS = ("rwkv", "xlstm")


def recurrent_issue(config: Any, attention: str = "all_gather") -> str | None:
    """Why context parallelism cannot split a model with recurrent layers (None: it can, or it has none): a
    recurrent model type, or recurrent layers (transformers' ``linear_attention`` / ``hybrid`` / ``conv``
    ``layer_types``: Nemotron-H's Mamba, Qwen3.5's gated delta rule, ...) under torch's ring attention; the
    all-gather attention runs their mixers on the whole rows (:mod:`.recurrent_layers`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) in RECURRENT_MODELS:
        return (f"the {text.model_type} model is recurrent: its state runs along the whole sequence; context "
                "parallelism would run it on each rank's part of it alone and train another model; set cp_size: 1")
    count = recurrent_layer_count(config)
    if not count or attention == "all_gather":
        return None
    return (f"{count} of the model's layers are recurrent or convolve along the sequence (Mamba, linear attention, "
            "short convolutions), whose state runs along the whole sequence: the all-gather attention runs them on "
            "the whole rows, torch's ring attention cannot; set distributed.cp_attention: all_gather (or auto)")


def sliding_window_issue(config: Any) -> str | None:
    """Why ring attention (one causal attention over the whole split sequence) is not the model's attention, for a
    model with sliding-window layers (None: it has none): ``sliding_attention`` among its ``layer_types``, or, with
    no ``layer_types``, a ``sliding_window`` every layer uses (Mistral, Mixtral, Phi-3)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if ("sliding_attention" not in layer_types) if layer_types else window is None:
        return None
    return (f"the model's sliding-window layers see only the last {window if window is not None else '?'} tokens, "
            "but torch's ring attention runs one causal attention over the whole split sequence, which would train "
            "another attention; set distributed.cp_attention: all_gather (or auto), or cp_size: 1")


def fsdp_mesh(mesh: DeviceMesh, layout: MeshLayout) -> DeviceMesh:
    """The mesh FSDP2 shards over: :func:`data_parallel_mesh`, its ``dp_shard`` joined with ``cp`` when cp > 1
    (the ``cp`` ranks of a batch hold partial gradients, which FSDP's reduction must include)."""
    if layout.cp == 1:
        return data_parallel_mesh(mesh, layout)
    joined = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard_cp"] if layout.dp_replicate > 1 else joined


def next_token_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX, shifted: bool = False
                       ) -> torch.Tensor:
    """``labels`` shifted left along the sequence: position ``i`` holds the label of token ``i + 1`` (the last
    position ``ignore_index``), so the targets can be split over ranks with the tokens; ``shifted``: the labels
    are those targets already (a copy of them)."""
    if shifted:
        return labels.clone()
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    return targets


@dataclass
class ContextParallelBatch:
    """A micro-batch in the form context parallelism splits: token ids, their positions, next-token targets."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    # the whole rows' padding mask (None: no padding, or packed rows): the all-gather attention's mask reads it
    attention_mask: torch.Tensor | None = None
    # the whole rows' spans that attend both ways (a Gemma 3's images; None: causal): the all-gather attention's mask
    spans: TwoWaySpans | None = None

    @classmethod
    def from_labels(cls, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, shifted: bool = False) -> ContextParallelBatch:
        """The batch's own ``position_ids`` where it has them, else each row's ``0 .. length - 1``; the tensors
        are new ones (the region splits them in place, the collated batch stays whole). ``shifted``: ``labels``
        are already the next tokens' (see :func:`next_token_targets`)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[SEQUENCE_DIM], device=input_ids.device).expand_as(input_ids)
        return cls(input_ids.clone(), position_ids.clone().contiguous(), next_token_targets(labels, shifted=shifted),
                   attention_mask)

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
    mine = part_indices(tensor.shape[dim], cp_mesh.size(), cp_mesh.get_local_rank())
    return tensor.index_select(dim, mine.to(tensor.device))


def _check_length(length: int, cp_mesh: DeviceMesh) -> None:
    chunks = 2 * cp_mesh.size()
    if length % chunks:
        raise AutomodelError(f"context parallelism over {cp_mesh.size()} ranks splits each sequence into {chunks} "
                             f"chunks, but this batch's sequences have {length} positions; pad them to a multiple "
                             f"of {chunks}")


def pipeline_parts(cp_mesh: DeviceMesh, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any],
                   whole_inputs: bool = False, shifted: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """A pipeline batch (token ids, labels, the stages' keyword arguments) as its stages run it with context
    parallelism: this rank's part of the token ids (``whole_inputs``: the whole rows', for a first stage that
    merges media into them before it splits, ``PipelineStageModel.takes_whole_rows``) and of the next-token
    targets (shifted before the split unless ``shifted``, as :class:`ContextParallelBatch`), the keyword arguments
    of the whole rows (each row's ``0 .. length - 1`` as its positions where it has none) with ``cp_mesh``, from
    which each stage runs its layers in the all-gather attention's region (``PipelineStageModel.forward``)."""
    _check_length(labels.shape[SEQUENCE_DIM], cp_mesh)
    if "position_ids" not in kwargs:
        kwargs = {**kwargs, "position_ids": torch.arange(inputs.shape[SEQUENCE_DIM], device=inputs.device)
                  .expand(inputs.shape[0], -1)}
    return (inputs if whole_inputs else split_sequence(inputs, cp_mesh),
            split_sequence(next_token_targets(labels, shifted=shifted), cp_mesh), {**kwargs, "cp_mesh": cp_mesh})


@contextlib.contextmanager
def context_parallel_region(cp_mesh: DeviceMesh, batch: ContextParallelBatch, attention: str = "ring"
                            ) -> Iterator[None]:
    """Run the micro-batch's forward *and* backward inside: the batch's tensors hold this rank's part of the
    sequence (in place; not restored) and causal SDPA runs as ``attention`` over ``cp_mesh``: torch's ring
    attention, or the all-gather attention (its mask from the whole rows' positions and padding)."""
    buffers = batch.split_in_place()
    length = batch.targets.shape[SEQUENCE_DIM]
    _check_length(length, cp_mesh)
    if attention == "all_gather":
        with all_gather_region(cp_mesh, length, batch.position_ids, batch.attention_mask, buffers, batch.spans):
            yield
        return
    if batch.spans is not None:  # validation refuses it where it can read the model
        raise AutomodelError("distributed.cp_attention: ring: this model lets spans of tokens (its images) attend to "
                             "each other both ways, which torch's ring attention (causal) does not compute; set "
                             "distributed.cp_attention: all_gather")
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain = F.scaled_dot_product_attention
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]), \
            context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[SEQUENCE_DIM] * len(buffers),
                             no_restore_buffers=set(buffers)):
        with SplitRegion.entered(F.scaled_dot_product_attention, plain):  # ring attention: the causal calls
            yield


def causal_attention_without_mask(model: nn.Module, skip: Collection[nn.Module] = (), none_is_fine: bool = False
                                  ) -> int:
    """Make every attention module of ``model``'s transformer blocks run without a mask inside the context-parallel
    region (the model's mask, built from the split position ids, would not match the region's attention; each
    module's sliding window is noted for the all-gather attention's mask); returns how many were hooked. The modules
    are found below wrappers (activation checkpointing) too; those inside ``skip`` (a vision-language model's
    towers, which see whole images) are left as they are. None found is an error unless ``none_is_fine`` (a pipeline
    stage of recurrent or MLP layers only).

    A module whose model asked for ``eager`` attention runs transformers' SDPA attention inside the region (the
    region's attention replaces SDPA calls, which eager's matrix products never make): the same softmax(QK^T / s)V,
    its scale, dropout and the region's exact mask; outside, it stays eager. Eager's logit soft-capping (Gemma 2),
    which SDPA lacks, is refused before (:func:`eager_issue`)."""
    switched: set[nn.Module] = set()

    def drop_mask(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if not SplitRegion.active:  # whole sequences (validation, generation): the model's own mask
            return None
        SplitRegion.note(module)  # the all-gather attention's mask for this layer
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) == "eager":
            config._attn_implementation = "sdpa"  # for this module's call; restore_eager sets it back
            switched.add(module)
        return args, {**kwargs, "attention_mask": None}

    def restore_eager(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if module in switched:
            switched.discard(module)
            module.config._attn_implementation = "eager"

    modules = attention_modules(model, skip)
    for module in modules:
        module.register_forward_pre_hook(drop_mask, with_kwargs=True)
        module.register_forward_hook(restore_eager, with_kwargs=True, always_call=True)
    hooked = len(modules)
    if not hooked and not none_is_fine:
        raise AutomodelError(f"context parallelism found no attention module in the layers of "
                             f"'{type(model).__name__}'")
    return hooked


def built_attention_issue(config: Any, attention: str = "all_gather") -> str | None:
    """Why a built model's attention implementation (its text config's) cannot run inside the context-parallel
    region of ``attention`` (None: it can): the region replaces SDPA calls, so sdpa runs, and eager too with the
    all-gather attention (:func:`causal_attention_without_mask`), unless :func:`eager_issue` says otherwise."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = getattr(text, "_attn_implementation", None)
    runs = (None, "sdpa", "eager") if attention == "all_gather" else (None, "sdpa")
    if implementation not in runs:
        return (f"'{implementation}': context parallelism replaces the language model's SDPA calls; use "
                f"{' or '.join(runs[1:])} (or set distributed.cp_size: 1)")
    return eager_issue(config) if implementation == "eager" else None


def eager_issue(config: Any) -> str | None:
    """Why a model's ``eager`` attention cannot run as the context-parallel region's SDPA attention (None: it can):
    logit soft-capping inside the attention (Gemma 2's ``attn_logit_softcapping``), which SDPA does not compute."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if (cap := getattr(text, "attn_logit_softcapping", None)) is not None:
        return (f"'eager' with attn_logit_softcapping {cap}: context parallelism runs the attention as SDPA with an "
                "exact mask, and SDPA does not soft-cap the attention logits; set distributed.cp_size: 1")
    return None
