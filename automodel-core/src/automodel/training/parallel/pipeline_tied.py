"""A tied output head under pipeline parallelism.

A model that ties its output head to its input embedding (``tie_word_embeddings``) uses one weight at both ends, but
pipeline stages hold those ends apart: the first stage the embedding, the last the head. :func:`untie_head` gives the
head a weight of its own before the cut (trainable where the embedding trains: :func:`frozen_embedding_key` says
whether ``freeze.embeddings``, upstream's ``freeze_config.freeze_embeddings`` or LoRA keeps it frozen), and
:class:`TiedHead` keeps the two one weight on two ranks:

- once the stages hold values, :meth:`TiedHead.copy_weight` sends the first stage's embedding to the last stage's
  head, to each rank the part its shard of the head holds, so the head is the embedding whatever the weights were read
  from (a tied checkpoint has no head tensor) or initialised with;
- where the weight trains, after each step's backward :meth:`TiedHead.sum_grads` gives both copies the sum of their
  gradients (what the one tied weight gets in one process), so the optimizer, given the same values, gradients and
  state, updates both alike; the gradient norm counts that gradient once (:attr:`TiedHead.copy`).

The run's config and its HF export then say ``tie_word_embeddings: false``, with a head equal to the embedding
(``transformers`` loads it as the same model). A distillation teacher (frozen as a whole) is untied the same way.
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
    LoRA's section, the core's ``freeze.embeddings`` or upstream's ``freeze_config.freeze_embeddings`` /
    ``freeze_language_model`` (the VLM recipe's; the latter freezes the embedding with the language model, and
    upstream's head stays trainable only where it is not the embedding)."""
    if cfg.get("peft") is not None:
        return "peft"
    freeze = cfg.get("freeze")
    if freeze is not None and _setting(freeze, "embeddings"):
        return "freeze.embeddings"
    upstream = cfg.get("freeze_config")
    for key in ("freeze_embeddings", "freeze_language_model"):
        if upstream is not None and _setting(upstream, key):
            return f"freeze_config.{key}"
    return None


def _setting(section: Any, name: str) -> bool:
    return bool(section.get(name) if isinstance(section, dict) else getattr(section, name, False))


def ties_head(model: nn.Module) -> bool:
    """Whether ``model``'s config ties its output head to its input embedding."""
    config = getattr(model, "config", None)
    return config is not None and bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def untie_head(model: nn.Module, trainable: bool = False) -> bool:
    """Give the output head of a model that ties it to the input embedding a weight of its own (a copy: the same
    values where ``model`` has them, another meta tensor on the meta device), ``trainable`` or frozen, and say so in
    its config (``tie_word_embeddings: false``); returns whether it did."""
    head = model.get_output_embeddings() if ties_head(model) else None
    if head is None:  # nothing tied, or no head to untie (the cut then refuses the model)
        return False
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=trainable)
    model.config.get_text_config().tie_word_embeddings = model.config.tie_word_embeddings = False
    return True


def head_copy_sources(model: nn.Module) -> dict[str, str]:
    """The untied head copies ``model`` (a stage, several, or any model) holds: their weight's name -> the input
    embedding weight's, whose values (and optimizer state) they take from a checkpoint written with the weight
    tied (no pipeline stages), which has no head tensor of its own."""
    from automodel.training.parallel.pipeline_stages import is_stage, stage_models

    if not is_stage(model):
        return {}
    ties = {id(tied): tied for stage in stage_models(model) if (tied := getattr(stage, "tied_head", None))}
    return {head: source for tied in ties.values() for head, source in tied.sources.items()}


class TiedHead:
    """The first stage's input embedding and the last stage's copy of it as the head, on this rank's pipeline
    (``pp_ranks``: its global ranks in stage order; ``device``: where the collectives' tensors go), made when the
    model is cut (the weights are read when used: materialisation and sharding replace them). Every rank of the
    pipeline makes one and calls its methods; the middle stages' ranks do nothing."""

    def __init__(self, stages: list[PipelineStageModel], pp_ranks: list[int], device: torch.device):
        self.first = next((s for s in stages if s.is_first), None)
        self.last = next((s for s in stages if s.is_last), None)
        self.sender, self.receiver, self.device = pp_ranks[0], pp_ranks[-1], device
        self.trains = False

    @property
    def embedding(self) -> torch.Tensor | None:
        return self.first.input_embedding.weight if self.first is not None else None

    @property
    def copy(self) -> torch.Tensor | None:
        """The head's weight: the embedding's copy (on the last stage's rank)."""
        return self.last.output_head.weight if self.last is not None else None

    @property
    def sources(self) -> dict[str, str]:
        """The head copy this rank holds, by its weight's name -> the embedding weight's (the whole model's)."""
        if self.last is None:
            return {}
        return {f"{self.last.head_name}.weight": f"{self.last.embedding_name}.weight"}

    def copy_weight(self) -> None:
        """Overwrite the head with the embedding: each rank holding the first stage sends the rank holding the last
        the part of the embedding that rank's shard of the head holds: its own shard where both are sharded alike,
        else that part of the whole embedding (gathered over the first stage's ranks, once). Both first exchange
        what they hold and fail alike where the weights differ in size, only one trains, or a trained pair is
        sharded apart."""
        if self.embedding is not None:
            mine = _describe(self.embedding)
            theirs = self._swap(mine, self.receiver, send_first=True)
            _check(mine, theirs)
            if theirs[_CRC] == mine[_CRC]:  # sharded alike (every pair of the two stages sees the same)
                part = local_slices(self.embedding)[0]
            else:
                whole = self.embedding.full_tensor() if hasattr(self.embedding, "full_tensor") else self.embedding
                part = whole[_slices(theirs)]
            dtype = _DTYPES[int(theirs[_DTYPE])]
            dist.send(part.detach().to(device=self.device, dtype=dtype).contiguous(), dst=self.receiver)
            self.trains = bool(mine[_TRAINS])
        if self.copy is not None:
            mine = _describe(self.copy)
            theirs = self._swap(mine, self.sender, send_first=False)
            _check(theirs, mine)
            local = local_slices(self.copy)[0]
            received = torch.empty(local.shape, dtype=local.dtype, device=self.device)
            dist.recv(received, src=self.sender)
            with torch.no_grad():
                local.copy_(received.to(local.device))
            self.trains = bool(mine[_TRAINS])

    def sum_grads(self) -> None:
        """Where the weight trains: the embedding's and the head's gradients (this rank's shard of each, sharded
        alike) exchanged and both set to their sum, added in the same order on both ranks."""
        if not self.trains:
            return
        for weight, peer in ((self.embedding, self.receiver), (self.copy, self.sender)):
            if weight is None:
                continue
            grad = local_slices(weight.grad)[0]
            theirs = torch.empty_like(grad, device=self.device)
            mine = grad.to(self.device)
            if weight is self.embedding:
                dist.send(mine, dst=peer)
                dist.recv(theirs, src=peer)
                total = mine + theirs  # embedding + head, on both ranks
            else:
                dist.recv(theirs, src=peer)
                dist.send(mine, dst=peer)
                total = theirs + mine
            grad.copy_(total.to(grad.device))

    def _swap(self, mine: torch.Tensor, peer: int, send_first: bool) -> torch.Tensor:
        """Send this rank's description to ``peer`` and receive its (in the order that pairs with the peer's)."""
        theirs = torch.empty_like(mine, device=self.device)
        if send_first:
            dist.send(mine.to(self.device), dst=peer)
            dist.recv(theirs, src=peer)
        else:
            dist.recv(theirs, src=peer)
            dist.send(mine.to(self.device), dst=peer)
        return theirs.cpu()


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
    if not torch.equal(embedding[_SHAPE], head[_SHAPE]):
        raise AutomodelError(f"the model ties its output head to its input embedding, but the first stage's "
                             f"embedding is {embedding[_SHAPE].tolist()} and the last stage's head "
                             f"{head[_SHAPE].tolist()}; set distributed.pp_size: 1")
    if embedding[_TRAINS] != head[_TRAINS]:
        raise AutomodelError("the model ties its output head to its input embedding, but on the pipeline's first "
                             f"stage that weight {'trains' if embedding[_TRAINS] else 'is frozen'} and on the last "
                             f"{'trains' if head[_TRAINS] else 'is frozen'}; freeze it with freeze.embeddings: true "
                             "(not freeze.patterns or unfreeze_modules) or let it train")
    if embedding[_TRAINS] and embedding[_CRC] != head[_CRC]:
        raise AutomodelError("the model ties its output head to its input embedding, which trains here, but the "
                             "pipeline's first and last stage shard it differently (the tensor-parallel plan), so "
                             "their gradients cannot be summed shard by shard; freeze it (freeze.embeddings: true), "
                             "untie them (tie_word_embeddings: false) or set distributed.tp_size: 1")
