"""Ranking metrics: recall@k and MRR of queries ranked against a corpus, accuracy and MRR of candidate groups.

Ties count against the positive (a model that scores everything alike ranks every positive last), so a
collapsed model can never look good.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def ranking_metrics(scores: torch.Tensor, positive_ids: Sequence[set[int]], ks: Iterable[int] = (1, 5, 10)
                    ) -> dict[str, float]:
    """``scores`` [Q, N] of each query against each document; ``positive_ids[q]`` its relevant documents.

    A positive's rank is 1 + the number of other documents scoring at least as high. recall@k: the share of a
    query's positives ranked within k, averaged over queries; mrr: the mean of 1 / the best positive's rank.
    """
    scores = scores.float()
    ks = sorted({int(k) for k in ks})
    recall = {k: 0.0 for k in ks}
    reciprocal, count = 0.0, 0
    for q, positives in enumerate(positive_ids):
        if not positives:
            continue
        count += 1
        row = scores[q]
        own = row[sorted(positives)]
        ranks = (row[None, :] >= own[:, None]).sum(dim=1)  # includes the positive itself: rank 1 = alone on top
        reciprocal += 1.0 / float(ranks.min())
        for k in ks:
            recall[k] += float((ranks <= k).float().mean())
    count = max(count, 1)
    metrics = {f"recall@{k}": value / count for k, value in recall.items()}
    metrics["mrr"] = reciprocal / count
    return metrics


def group_metrics(scores: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor) -> tuple[float, float, float]:
    """Sums over groups [B, G] of (positive ranked first, 1 / the positive's rank, 1 / group size = chance)."""
    scores = scores.float()
    positive = scores.gather(1, labels[:, None])
    rank = ((scores >= positive) & valid).sum(dim=1).clamp(min=1)
    correct = (rank == 1).float().sum().item()
    return correct, (1.0 / rank.float()).sum().item(), (1.0 / valid.sum(dim=1).float()).sum().item()
