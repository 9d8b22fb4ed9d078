"""A tied output head under pipeline parallelism.

A model that ties its output head to its input embedding (``tie_word_embeddings``) uses one weight at both ends, but
pipeline stages hold those ends apart: the first stage the embedding, the last the head. The two stay one weight while
neither trains, so such a model is cut where that weight is frozen (:func:`frozen_embedding_key`: ``freeze.embeddings``,
upstream's ``freeze_config.freeze_embeddings``, or LoRA, which freezes every base weight): :func:`untie_head` gives the
head a frozen weight of its own before the cut, and once the stages hold values :func:`copy_embedding_to_head` sends the
first stage's embedding to the last stage's head, to each rank the part its shard of the head holds, so the head is the
embedding whatever the weights were read from (a tied checkpoint has no head tensor) or initialised with. The run's
config and its HF export then say ``tie_word_embeddings: false``, with a head equal to the embedding (``transformers``
loads it as the same model). A distillation teacher (frozen as a whole) is untied the same way.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.errors import AutomodelError
from automodel.training.parallel.module_init import local_slices

if TYPE_CHECKING:
    from automodel.training.parallel.pipeline_stages import PipelineStageModel

def frozen_embedding_key(cfg: Any) -> str | None:
    """The key of ``cfg`` that keeps the input embedding (so a tied head) from training, None where none does:
    LoRA's section, the core's ``freeze.embeddings`` or upstream's ``freeze_config.freeze_embeddings`` (the VLM
    recipe's)."""
    if cfg.get("peft") is not None:
        return "peft"
    freeze = cfg.get("freeze")
    if freeze is not None and _setting(freeze, "embeddings"):
        return "freeze.embeddings"
    upstream = cfg.get("freeze_config")
    if upstream is not None and _setting(upstream, "freeze_embeddings"):
        return "freeze_config.freeze_embeddings"
    return None


def _setting(section: Any, name: str) -> bool:
    return bool(section.get(name) if isinstance(section, dict) else getattr(section, name, False))


def ties_head(model: nn.Module) -> bool:
    """Whether ``model``'s config ties its output head to its input embedding."""
    config = getattr(model, "config", None)
    return config is not None and bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def untie_head(model: nn.Module) -> bool:
    """Give the output head of a model that ties it to the input embedding a frozen weight of its own (a copy:
    the same values where ``model`` has them, another meta tensor on the meta device) and say so in its config
    (``tie_word_embeddings: false``); returns whether it did."""
    if not ties_head(model):
        return False
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.config.get_text_config().tie_word_embeddings = model.config.tie_word_embeddings = False
    return True


def copy_embedding_to_head(stages: list[PipelineStageModel], pp_ranks: list[int], device: torch.device) -> None:
    """Overwrite the last stage's head weight with the first stage's input embedding: each rank holding the first
    stage sends the rank holding the last (``pp_ranks``: the global ranks of this rank's pipeline, in stage order)
    the part of the embedding that rank's shard of the head holds: its own shard where both are sharded alike, else
    that part of the whole embedding (gathered over the first stage's ranks, once). Both first exchange what they
    hold and fail alike where the weights differ in size or either trains. Every rank of the pipeline calls it (the
    middle ones do nothing)."""
    first = next((s for s in stages if s.is_first), None)
    last = next((s for s in stages if s.is_last), None)
    sender, receiver = pp_ranks[0], pp_ranks[-1]
    if first is not None:
        embedding = first.input_embedding.weight
        mine = _describe(embedding)
        dist.send(mine.to(device), dst=receiver)
        theirs = torch.empty_like(mine, device=device)
        dist.recv(theirs, src=receiver)
        theirs = theirs.cpu()
        _check(mine, theirs)
        if theirs[_CRC] == mine[_CRC]:  # sharded alike (every pair of the two stages sees the same): its own shard
            part = local_slices(embedding)[0]
        else:
            whole = embedding.full_tensor() if hasattr(embedding, "full_tensor") else embedding
            part = whole[_slices(theirs)]
        dist.send(part.detach().to(device=device, dtype=_DTYPES[int(theirs[_DTYPE])]).contiguous(), dst=receiver)
    if last is not None:
        head = last.output_head.weight
        mine = _describe(head)
        theirs = torch.empty_like(mine, device=device)
        dist.recv(theirs, src=sender)
        dist.send(mine.to(device), dst=sender)
        _check(theirs.cpu(), mine)
        local = local_slices(head)[0]
        received = torch.empty(local.shape, dtype=local.dtype, device=device)
        dist.recv(received, src=sender)
        with torch.no_grad():
            local.copy_(received)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DIMS = 2  # an embedding's weight: [vocabulary, hidden]
_SHAPE, _STARTS, _STOPS = slice(0, _DIMS), slice(_DIMS, 2 * _DIMS), slice(2 * _DIMS, 3 * _DIMS)
_DTYPE, _CRC, _TRAINS = 3 * _DIMS, 3 * _DIMS + 1, 3 * _DIMS + 2


def _describe(weight: torch.Tensor) -> torch.Tensor:
    """A weight's shape, this rank's slice of it, its dtype, a checksum of its placements and whether it trains,
    as int64s."""
    local, slices = local_slices(weight)
    if weight.dim() != _DIMS or local.dtype not in _DTYPES:
        raise AutomodelError(f"the tied input embedding's weight is {tuple(weight.shape)} {local.dtype}; a pipeline "
                             "copies a two-dimensional float one to its last stage; set distributed.pp_size: 1")
    placements = zlib.crc32(str(tuple(getattr(weight, "placements", ()))).encode())
    return torch.tensor([*weight.shape, *(s.start for s in slices), *(s.stop for s in slices),
                         _DTYPES.index(local.dtype), placements, int(weight.requires_grad)], dtype=torch.int64)


def _slices(description: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(int(a), int(b)) for a, b in zip(description[_STARTS], description[_STOPS], strict=True))


def _check(embedding: torch.Tensor, head: torch.Tensor) -> None:
    """Both ends call it with the same two descriptions, so both fail alike."""
    if bool(embedding[_TRAINS]) or bool(head[_TRAINS]):
        raise AutomodelError("the model ties its output head to its input embedding, which the first and the last "
                             "pipeline stage hold apart, but that weight trains here, so the two would drift apart; "
                             "freeze it (freeze.embeddings: true), train LoRA adapters (peft:), untie them "
                             "(tie_word_embeddings: false), or set distributed.pp_size: 1")
    if not torch.equal(embedding[_SHAPE], head[_SHAPE]):
        raise AutomodelError(f"the model ties its output head to its input embedding, but the first stage's "
                             f"embedding is {embedding[_SHAPE].tolist()} and the last stage's head "
                             f"{head[_SHAPE].tolist()}; set distributed.pp_size: 1")
