"""All-gather context parallelism (Llama 3's): each ``cp`` rank keeps the queries of its part of the sequence,
gathers every rank's keys and values, and runs SDPA over them with an exact mask built from global token indices.

Unlike torch's ring attention it needs no CUDA kernel (SDPA runs on any device) and it can mask: the mask is causal
on the global token index, hides padding (``attention_mask`` zeros), keeps packed documents apart (rows without an
attention mask whose ``position_ids`` do not step by one start a new document, transformers' own rule,
``find_packed_sequence_indices``) and applies each layer's sliding window (the attention module's
``sliding_window``, else its config's) and, where the model asks for it (:class:`TwoWaySpans`: Gemma 3's and
PaliGemma's image tokens, Gemma 4's on its sliding layers), lets the tokens of one span see each other both ways,
as transformers' ``blockwise_overlay`` does. Keys keep the order of the gather (rank 0's part, rank 1's, ...): softmax
does not depend on the order, and the mask uses each key's global index.

The gather is differentiable (:class:`_GatheredParts`): backward sums the gradient over the ``cp`` group and
keeps this rank's part, which is the gradient of every rank's loss with respect to this rank's keys and values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class SplitRegion:
    """Whether a context-parallel region is entered, its attention, and the sliding window of the attention layer
    that runs now (None: full causal attention). Inside, causal SDPA calls run the region's attention, and the
    attention modules run without the model's mask (built from a rank's split positions it would be wrong; the
    region's attention has its own) and note their window for the mask (the SDPA call itself does not say which
    layer it belongs to); outside (validation, generation: whole sequences on every rank) they keep the model's own
    mask and SDPA."""

    active: bool = False
    window: int | None = None
    attention: tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None = None  # (causal, plain)
    sequence: WholeSequence | None = None  # how to gather the whole rows (the all-gather attention's region)

    @classmethod
    @contextlib.contextmanager
    def entered(cls, causal: Callable[..., torch.Tensor], plain: Callable[..., torch.Tensor],
                sequence: WholeSequence | None = None) -> Iterator[None]:
        """Within the block causal SDPA calls run ``causal``, the others ``plain`` (:func:`causal_calls_to`);
        ``sequence``: how a layer that must see whole rows gathers them (:mod:`.recurrent_layers`)."""
        before = cls.active, cls.attention, cls.sequence
        cls.active, cls.window, cls.attention, cls.sequence = True, None, (causal, plain), sequence
        try:
            with causal_calls_to(causal, plain):
                yield
        finally:
            cls.active, cls.attention, cls.sequence = before

    @classmethod
    def recomputation(cls) -> contextlib.AbstractContextManager:
        """Taken in a checkpointed block's forward (activation checkpointing's recomputation context): the region
        the forward runs in, entered again for the block's recomputation in backward where none is entered then.
        A pipeline schedule runs a micro-batch's backward after its stage's forward left the region; without a
        pipeline the region holds the backward too, and this does nothing."""
        attention, sequence = (cls.attention, cls.sequence) if cls.active else (None, None)

        @contextlib.contextmanager
        def again() -> Iterator[None]:
            if attention is None or cls.active:
                yield
                return
            with cls.entered(*attention, sequence=sequence):
                yield

        return again()

    @classmethod
    def note(cls, module: nn.Module) -> None:
        """Record ``module``'s window: its own ``sliding_window`` (Gemma 3, Qwen2: per layer), else its config's
        (Mistral, Mixtral, Phi-3: every layer)."""
        if hasattr(module, "sliding_window"):
            cls.window = module.sliding_window
        else:
            cls.window = getattr(getattr(module, "config", None), "sliding_window", None)


class _GatheredParts(torch.autograd.Function):
    """Every ``cp`` rank's part of a tensor, in rank order along ``dim`` (the keys and values ``[2, batch, heads,
    part, dim]``: dim 3; a layer's input ``[batch, part, hidden]``: dim 1)."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size, ctx.dim = group, dist.get_rank(group), dist.get_world_size(group), dim
        part = part.contiguous()
        parts = [torch.empty_like(part) for _ in range(ctx.size)]
        dist.all_gather(parts, part, group=group)  # into a list: every backend has it, gloo included
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's computation used this rank's part
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None


@dataclass(frozen=True)
class WholeSequence:
    """What gathers this rank's part of a ``[batch, part, ...]`` tensor into the whole rows, and takes its part
    back: the ``cp`` group, this rank's token indices and the whole rows' padding mask (None: no padding)."""

    group: Any
    size: int
    length: int
    mine: torch.Tensor
    attention_mask: torch.Tensor | None

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """The whole rows in their own order (differentiable: backward sums every rank's gradient of them)."""
        order = torch.cat([part_indices(self.length, self.size, rank) for rank in range(self.size)])
        gathered = _GatheredParts.apply(part, self.group, 1)
        return gathered.index_select(1, torch.argsort(order).to(part.device))

    def part(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.index_select(1, self.mine.to(whole.device))


@dataclass(frozen=True)
class TwoWaySpans:
    """Spans of tokens that attend to each other both ways (the rest causal), as transformers' ``block_sequence_ids``:
    ``ids`` ``[batch, sequence]``, one number a span, -1 outside any. ``full_layers``: whether the full-attention
    layers apply them too (Gemma 3, PaliGemma) or only the sliding-window ones (Gemma 4)."""

    ids: torch.Tensor
    full_layers: bool = True


def part_indices(length: int, size: int, rank: int) -> torch.Tensor:
    """The global token indices rank ``rank`` of ``size`` holds: chunks ``rank`` and ``2 size - 1 - rank`` of
    ``2 size`` (the layout ``split_sequence`` and torch's context_parallel give)."""
    chunks = torch.arange(length).chunk(2 * size)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]])


def documents(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``[batch, sequence]`` document numbers of packed rows (None: each row is one sequence): transformers'
    rule, only for rows without an attention mask, where a position not one above the previous starts a document
    (of ``[4, batch, sequence]`` multi-axis positions, the text row first, the text row's)."""
    if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 4:
        position_ids = position_ids[0]
    if attention_mask is not None or position_ids is None or position_ids.dim() != 2:
        return None
    steps = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (steps != 1).cumsum(-1)


class GatheredVisibility:
    """Which gathered key each of this rank's queries sees, for a micro-batch (global tensors, before the split):
    causal on the global index (or within a :class:`TwoWaySpans` span), within the query's document, not padding
    (wherever it is in the row); each query sees itself, so a padding row's softmax has a key (its output reaches no
    real token: no real token sees a padding key)."""

    def __init__(self, length: int, cp_mesh: DeviceMesh, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, spans: TwoWaySpans | None = None):
        size, rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.queries = part_indices(length, size, rank).to(position_ids.device)
        self.keys = torch.cat([part_indices(length, size, r) for r in range(size)]).to(position_ids.device)
        docs = documents(position_ids, attention_mask)
        self.causal = (self.keys[None, :] <= self.queries[:, None])[None]  # [1, queries, keys]
        keep = torch.ones_like(self.causal)  # [1 or batch, queries, keys]: within the document, not padding
        if docs is not None:
            keep = keep & (docs[:, self.keys][:, None, :] == docs[:, self.queries][:, :, None])
        if attention_mask is not None:
            keep = keep & attention_mask.bool()[:, self.keys][:, None, :]
        self.keep = keep
        self.spans = spans
        if spans is not None:
            ids = spans.ids.to(position_ids.device)
            queries = ids[:, self.queries][:, :, None]
            self.same_span = (queries == ids[:, self.keys][:, None, :]) & (queries >= 0)
        self.itself = self.keys[None, :] == self.queries[:, None]
        self._by_window: dict[int | None, torch.Tensor] = {}

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The ``[batch, 1, queries, keys]`` boolean mask of a layer with ``window`` (transformers' sliding window:
        a key less than ``window`` tokens before the query, applied after the spans, as transformers does)."""
        if window not in self._by_window:
            mask = self.causal
            if self.spans is not None and (window is not None or self.spans.full_layers):
                mask = mask | self.same_span
            mask = mask & self.keep
            if window is not None:
                mask = mask & (self.queries[:, None] - self.keys[None, :] < window)
            self._by_window[window] = (mask | self.itself)[:, None]
        return self._by_window[window]


def gathered_attention(cp_mesh: DeviceMesh, visibility: GatheredVisibility, plain: Callable[..., torch.Tensor]
                       ) -> Callable[..., torch.Tensor]:
    """A causal SDPA call's replacement: this rank's queries over every rank's keys and values, ``plain`` SDPA
    with :class:`GatheredVisibility`'s mask for the layer that runs (:class:`SplitRegion`)."""
    group = cp_mesh.get_group()

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        if key.shape == value.shape:  # one gather for both
            keys, values = _GatheredParts.apply(torch.stack([key, value]), group, 3).unbind(0)
        else:  # a latent attention's (DeepSeek-V3's, Kimi's): keys wider than values
            keys, values = _GatheredParts.apply(key, group, 2), _GatheredParts.apply(value, group, 2)
        groups = query.shape[1] // keys.shape[1]
        if groups > 1:  # grouped heads with a mask: CUDA's SDPA would fall back to its math kernel, so repeat them
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        return plain(query, keys, values, attn_mask=visibility.mask_for(SplitRegion.window).to(query.device),
                     dropout_p=dropout_p, scale=scale)

    return attention


@contextlib.contextmanager
def causal_calls_to(replacement: Callable[..., torch.Tensor], plain: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Within the block only causal SDPA calls run ``replacement``; the others (a vision encoder's bidirectional
    attention over whole images, which every rank holds) keep ``plain``. SDPA is what it was before, after."""
    before = F.scaled_dot_product_attention

    def route(*args: Any, **kwargs: Any) -> torch.Tensor:
        causal = kwargs.get("is_causal", len(args) > 5 and args[5])  # (query, key, value, mask, dropout, is_causal)
        return (replacement if causal else plain)(*args, **kwargs)

    F.scaled_dot_product_attention = route
    try:
        yield
    finally:
        F.scaled_dot_product_attention = before


@contextlib.contextmanager
def all_gather_region(cp_mesh: DeviceMesh, length: int, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, buffers: list[torch.Tensor],
                      spans: TwoWaySpans | None = None) -> Iterator[None]:
    """Split ``buffers`` along the sequence in place (this rank's chunks) and, within the block, run causal SDPA
    calls as :func:`gathered_attention` (the mask from the whole rows' ``position_ids``, ``attention_mask`` and
    two-way ``spans``)."""
    visibility = GatheredVisibility(length, cp_mesh, position_ids, attention_mask, spans)
    mine = visibility.queries
    for buffer in buffers:
        shard = buffer.index_select(1, mine.to(buffer.device))
        buffer.resize_(shard.shape)
        buffer.copy_(shard)
    plain = F.scaled_dot_product_attention
    sequence = WholeSequence(cp_mesh.get_group(), cp_mesh.size(), length, mine, attention_mask)
    with SplitRegion.entered(gathered_attention(cp_mesh, visibility, plain), plain, sequence):
        yield
