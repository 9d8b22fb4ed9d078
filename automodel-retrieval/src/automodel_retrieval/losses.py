"""Contrastive losses. Both return the SUM over queries (the engine divides by the step's query count)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _reduce(losses: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.mean()
    if reduction == "none":
        return losses
    raise ValueError(f"reduction must be 'sum', 'mean' or 'none', found {reduction!r}")


class InfoNCELoss(nn.Module):
    """InfoNCE over in-batch negatives plus hard negatives.

    Each query is scored against every document of the micro-batch (its own positive, the other queries'
    positives and every hard negative): ``similarity / temperature``; the target is its positive.
    ``exclude`` [B, D] marks documents that must not count as negatives for a query (another copy of one of its
    positives), so duplicates are never pushed away.
    """

    def __init__(self, temperature: float = 0.05, reduction: str = "sum"):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, found {temperature}")
        self.temperature, self.reduction = temperature, reduction

    def scores(self, query: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        return query.float() @ documents.float().T / self.temperature

    def forward(self, query: torch.Tensor, documents: torch.Tensor, labels: torch.Tensor,
                exclude: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.scores(query, documents)
        if exclude is not None:
            logits = logits.masked_fill(exclude, float("-inf"))
        return _reduce(F.cross_entropy(logits, labels, reduction="none"), self.reduction)


class ListwiseCrossEntropy(nn.Module):
    """Softmax cross-entropy over each group's scores [B, G] (a positive and its negatives); the target is the
    positive's column (``labels``, default 0). ``valid`` [B, G] masks padding of groups with fewer negatives."""

    def __init__(self, temperature: float = 1.0, reduction: str = "sum"):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, found {temperature}")
        self.temperature, self.reduction = temperature, reduction

    def forward(self, scores: torch.Tensor, valid: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = scores.float() / self.temperature
        if valid is not None:
            logits = logits.masked_fill(~valid, float("-inf"))
        if labels is None:
            labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return _reduce(F.cross_entropy(logits, labels, reduction="none"), self.reduction)
