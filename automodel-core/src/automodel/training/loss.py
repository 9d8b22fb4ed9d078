"""Token-weighted losses. The engine divides a step's summed loss by the step's label-token count."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class MaskedCrossEntropy(nn.Module):
    """Cross entropy over tokens whose label is not ``ignore_index``, computed in fp32.

    ``reduction="sum"`` (what the engine uses) gives the step's numerator; ``"mean"`` divides by this call's
    label tokens. All labels ignored gives 0, not NaN.
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX, reduction: str = "sum", fp32_upcast: bool = True):
        super().__init__()
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', found {reduction!r}")
        self.ignore_index, self.reduction, self.fp32_upcast = ignore_index, reduction, fp32_upcast

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1)
        if self.fp32_upcast:
            logits = logits.float()
        total = F.cross_entropy(logits, labels, ignore_index=self.ignore_index, reduction="sum")
        if self.reduction == "sum":
            return total
        count = (labels != self.ignore_index).sum()
        return total / count.clamp(min=1)


def as_sum_loss(loss_fn: nn.Module | None) -> nn.Module:
    """A loss that returns the sum over label tokens: ours, or a torch loss switched to ``reduction='sum'``."""
    if loss_fn is None:
        return MaskedCrossEntropy()
    if hasattr(loss_fn, "reduction"):
        loss_fn.reduction = "sum"
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        loss_fn.ignore_index = IGNORE_INDEX
    return loss_fn


def label_positions(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Flat indices into ``batch x sequence`` of the positions whose next token carries a label.

    Position ``i`` of a row predicts token ``i + 1``, so the logits a next-token loss needs are those at the flat
    indices returned here, and their targets are ``labels.view(-1)[index + 1]``.
    """
    keep = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    keep[:, :-1] = labels[:, 1:] != ignore_index
    return keep.view(-1).nonzero().squeeze(1)


class HeadOnPositions:
    """Lets a causal LM's output head project only chosen positions instead of every one.

    A next-token loss needs logits only where a label is: in supervised fine-tuning that is the answer, often a
    few percent of a batch's positions, and for a large vocabulary the full ``[batch, sequence, vocab]`` logits
    are a step's biggest activation and a large share of its FLOPs. A forward pre-hook on the model's output
    embeddings (``get_output_embeddings()``) gathers the chosen rows of the hidden states, so the model returns
    ``[positions, vocab]`` logits and still applies its own post-processing (soft-capping, logit scaling) to them.
    Each kept row's logits are computed exactly as before, so the loss and the gradients are the same.
    """

    def __init__(self, head: nn.Module):
        self._index: torch.Tensor | None = None
        head.register_forward_pre_hook(self._gather)

    @classmethod
    def attach(cls, model: nn.Module) -> HeadOnPositions | None:
        """The hook on ``model``'s output head, or None when the model has no separate head module."""
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        return cls(head) if isinstance(head, nn.Module) else None

    def _gather(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._index is None or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
            return None
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, self._index), *args[1:])

    @contextmanager
    def only(self, index: torch.Tensor) -> Iterator[None]:
        """Within the block the head projects only the flat positions ``index`` (see :func:`label_positions`)."""
        self._index = index
        try:
            yield
        finally:
            self._index = None
