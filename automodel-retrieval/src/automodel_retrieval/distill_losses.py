"""Embedding-distillation losses: the student's embeddings towards a frozen teacher's.

Each loss returns its value for one micro-batch as its ``reduction`` says (upstream's forms: the mean over the
batch by default); the distillation recipe weighs them (``distill_loss_weight`` ...) and the loop averages the
micro-batches. ``EmbeddingDistillLoss`` and ``EmbeddingMSELoss`` compare the student's *projected* embeddings
(the teacher's width) with the teacher's, for each query and its positive document; ``InfoNCEDistillLoss`` matches
the student's own ranking of candidate documents to the teacher's (softmax over the candidates' similarities).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DIRECTIONS = ("q2d", "d2q", "symmetric")
DIVERGENCES = ("kl", "ce", "mse")


def _choice_issues(kwargs: Mapping[str, Any], choices: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Validation's check of a loss section's keys (nothing is built): each named key's value among its choices,
    ``temperature`` > 0."""
    issues = {name: f"'{kwargs[name]}' is not one of {', '.join(allowed)}" for name, allowed in choices.items()
              if name in kwargs and kwargs[name] not in allowed}
    temperature = kwargs.get("temperature", 1)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
        issues["temperature"] = f"expected a number > 0, found {temperature!r}"
    return issues


def _check(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, found {value!r}")
    return value


class EmbeddingDistillLoss(nn.Module):
    """Cosine distance ``1 - cos(student, teacher)`` of the query and of the positive document, added; the mean
    (or sum) over the batch."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = _check("reduction", reduction, ("mean", "sum"))

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        return _choice_issues(kwargs, {"reduction": ("mean", "sum")})

    def forward(self, student_query: torch.Tensor, teacher_query: torch.Tensor, student_document: torch.Tensor,
                teacher_document: torch.Tensor) -> torch.Tensor:
        distance = (1 - F.cosine_similarity(student_query.float(), teacher_query.float(), dim=-1)
                    + 1 - F.cosine_similarity(student_document.float(), teacher_document.float(), dim=-1))
        return distance.mean() if self.reduction == "mean" else distance.sum()


class EmbeddingMSELoss(nn.Module):
    """Squared error between student and teacher embeddings (queries plus positive documents): the mean over
    elements (``mean``), their sum (``sum``) or the per-sample squared distance averaged over the batch
    (``batchmean``); ``normalize`` L2-normalises both sides first."""

    def __init__(self, normalize: bool = False, reduction: str = "mean"):
        super().__init__()
        self.normalize = normalize
        self.reduction = _check("reduction", reduction, ("mean", "sum", "batchmean"))

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        return _choice_issues(kwargs, {"reduction": ("mean", "sum", "batchmean")})

    def _side(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        student, teacher = student.float(), teacher.float()
        if self.normalize:
            student, teacher = F.normalize(student, dim=-1), F.normalize(teacher, dim=-1)
        if self.reduction == "batchmean":
            return (student - teacher).pow(2).sum(dim=-1).mean()
        return F.mse_loss(student, teacher, reduction=self.reduction)

    def forward(self, student_query: torch.Tensor, teacher_query: torch.Tensor, student_document: torch.Tensor,
                teacher_document: torch.Tensor) -> torch.Tensor:
        return self._side(student_query, teacher_query) + self._side(student_document, teacher_document)


class InfoNCEDistillLoss(nn.Module):
    """Listwise distillation: for each query, the student's softmax over its candidate documents' similarities
    (``/ temperature``) is pulled towards the teacher's, by KL(teacher || student) (``kl``), cross-entropy against
    the teacher's probabilities (``ce``) or the squared difference of the probabilities summed per query (``mse``);
    the mean over queries.

    Candidates: every document of the batch (``use_in_batch_negatives``: all positives and hard negatives), else a
    query's own positive and hard negatives (``candidates`` marks them). ``direction: d2q`` ranks the queries for
    each positive document instead, ``symmetric`` averages both. ``normalize`` scores with cosine similarity.
    ``cross_device_negatives`` (several ranks) adds every rank's documents to the candidates; the recipe gathers
    them.
    """

    def __init__(self, temperature: float = 0.05, direction: str = "q2d", use_in_batch_negatives: bool = True,
                 normalize: bool = True, divergence: str = "kl", cross_device_negatives: bool = True):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, found {temperature}")
        self.temperature = temperature
        self.direction = _check("direction", direction, DIRECTIONS)
        self.divergence = _check("divergence", divergence, DIVERGENCES)
        self.use_in_batch_negatives, self.normalize = use_in_batch_negatives, normalize
        self.cross_device_negatives = cross_device_negatives

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        return _choice_issues(kwargs, {"direction": DIRECTIONS, "divergence": DIVERGENCES})

    def _scores(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        rows, columns = rows.float(), columns.float()
        if self.normalize:
            rows, columns = F.normalize(rows, dim=-1), F.normalize(columns, dim=-1)
        return rows @ columns.T / self.temperature

    def _one_direction(self, student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Divergence of the student's [N, C] candidate scores from the teacher's, where ``valid``; mean over N."""
        student = student.masked_fill(~valid, float("-inf"))
        teacher = teacher.detach().masked_fill(~valid, float("-inf"))
        p_teacher = teacher.softmax(dim=-1)
        if self.divergence == "mse":
            return (student.softmax(dim=-1) - p_teacher).pow(2).sum() / student.shape[0]
        log_student = student.log_softmax(dim=-1)
        term = p_teacher * (teacher.log_softmax(dim=-1) - log_student) if self.divergence == "kl" \
            else -p_teacher * log_student
        return torch.where(valid, term, term.new_zeros(())).sum(dim=-1).mean()

    def forward(self, student_query: torch.Tensor, student_documents: torch.Tensor, teacher_query: torch.Tensor,
                teacher_documents: torch.Tensor, labels: torch.Tensor | None = None,
                candidates: torch.Tensor | None = None) -> torch.Tensor:
        """``*_documents`` [D, H]: query i's positive is document ``labels[i]`` (default i); ``candidates`` [B, D]:
        the documents query i may be ranked against (None: all of them)."""
        batch = student_query.shape[0]
        if labels is None:
            labels = torch.arange(batch, device=student_query.device)
        valid = torch.ones(batch, student_documents.shape[0], dtype=torch.bool, device=student_query.device)
        if candidates is not None:
            valid = valid & candidates
        losses = []
        if self.direction in ("q2d", "symmetric"):
            losses.append(self._one_direction(self._scores(student_query, student_documents),
                                              self._scores(teacher_query, teacher_documents), valid))
        if self.direction in ("d2q", "symmetric"):  # each positive ranks the batch's queries
            losses.append(self._one_direction(self._scores(student_documents[labels], student_query),
                                              self._scores(teacher_documents[labels], teacher_query),
                                              valid[:, labels].T))
        return sum(losses) / len(losses)
