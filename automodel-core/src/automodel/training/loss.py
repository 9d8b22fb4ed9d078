"""Token-weighted losses. The engine divides a step's summed loss by the step's label-token count."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from automodel.errors import ConfigIssue

if TYPE_CHECKING:
    from automodel.config import Config

IGNORE_INDEX = -100
CHUNKED = "automodel.training.loss.ChunkedCrossEntropy"
LINEAR = "automodel.training.linear_ce.LinearCrossEntropy"


class MaskedCrossEntropy(nn.Module):
    """Cross entropy over tokens whose label is not ``ignore_index``, computed in fp32.

    ``reduction="sum"`` (what the engine uses) gives the step's numerator; ``"mean"`` divides by this call's
    label tokens. All labels ignored gives 0, not NaN.
    """

    sums_in_fp32 = True  # as_sum_loss uses it as it is

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


class ChunkedCrossEntropy(MaskedCrossEntropy):
    """:class:`MaskedCrossEntropy` that upcasts ``chunk_len`` rows of logits to fp32 at a time instead of all of
    them: the forward keeps only each row's log-normaliser and target logit, the backward recomputes each chunk's
    softmax, so no fp32 copy of the whole ``[tokens, vocab]`` logits (nor its softmax) is ever held. The same loss
    and gradients as :class:`MaskedCrossEntropy`; with tensor parallelism, whose logits are sharded over the
    vocabulary, it is refused at validation (:func:`loss_fn_issues`).

    ``compile`` is upstream's switch for the path that reduces per chunk with ``torch.compile``; the engine sums the
    loss (``reduction='sum'``), a path upstream does not compile either, so it governs nothing (the run says so:
    :func:`chunked_loss_notes`)."""

    def __init__(self, chunk_len: int = 32, compile: bool = True, ignore_index: int = IGNORE_INDEX,
                 reduction: str = "sum"):
        super().__init__(ignore_index=ignore_index, reduction=reduction)
        if isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 1:
            raise ValueError(f"chunk_len must be a positive integer (rows of logits upcast at a time), found "
                             f"{chunk_len!r}")
        self.chunk_len, self.compile = chunk_len, compile

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1).to(logits.device)
        total = _ChunkedSum.apply(logits, labels, self.ignore_index, self.chunk_len)
        if self.reduction == "sum":
            return total
        return total / (labels != self.ignore_index).sum().clamp(min=1)


class _ChunkedSum(torch.autograd.Function):
    """The summed cross entropy of ``[tokens, vocab]`` logits, ``chunk_len`` fp32 rows at a time."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_len: int
                ) -> torch.Tensor:
        kept = labels != ignore_index
        targets = labels.masked_fill(~kept, 0)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows in torch.arange(logits.shape[0], device=logits.device).split(chunk_len):
            chunk = logits[rows].float()
            picked = chunk.gather(1, targets[rows].unsqueeze(1)).squeeze(1)
            total += ((torch.logsumexp(chunk, dim=-1) - picked) * kept[rows]).sum()
        ctx.save_for_backward(logits, targets, kept)
        ctx.chunk_len = chunk_len
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, targets, kept = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for rows in torch.arange(logits.shape[0], device=logits.device).split(ctx.chunk_len):
            chunk = torch.softmax(logits[rows].float(), dim=-1)  # d(logsumexp - picked) / d logits
            chunk[torch.arange(len(rows), device=chunk.device), targets[rows]] -= 1.0
            grad[rows] = (chunk * (kept[rows].unsqueeze(1) * grad_total)).to(grad.dtype)
        return grad, None, None, None


class Float32Loss(nn.Module):
    """Runs ``loss`` in float32 whatever precision the forward ran in: its floating-point tensor arguments are
    upcast and autocast is off inside it (a bf16 logit's rounding would otherwise enter the loss)."""

    def __init__(self, loss: nn.Module):
        super().__init__()
        self.loss = loss

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple(_upcast(a) for a in args)
        kwargs = {k: _upcast(v) for k, v in kwargs.items()}
        devices = [a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        with torch.autocast(devices[0] if devices else "cpu", enabled=False):
            return self.loss(*args, **kwargs)


def _upcast(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def as_sum_loss(loss_fn: nn.Module | None) -> nn.Module:
    """A loss that returns the sum over label tokens (the engine divides by the step's label tokens: the mean a
    ``reduction: mean`` asks for, over the whole step), computed in float32: ours (``sums_in_fp32``: they upcast
    themselves), or another wrapped in ``Float32Loss``; either switched to ``reduction='sum'``."""
    if loss_fn is None:
        return MaskedCrossEntropy()
    if hasattr(loss_fn, "reduction"):
        loss_fn.reduction = "sum"
    if getattr(loss_fn, "sums_in_fp32", False):
        return loss_fn
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        loss_fn.ignore_index = IGNORE_INDEX
    return Float32Loss(loss_fn)


def loss_fn_named(cfg: Config, path: str) -> Any:
    """The ``loss_fn`` section when it names the loss at ``path`` (by any alias), else None."""
    node = cfg.get("loss_fn")
    target = getattr(node, "target", None)
    return node if isinstance(target, str) and cfg.resolver.expand(target) == path else None


def loss_fn_issues(cfg: Config) -> list[ConfigIssue]:
    """Losses the layout cannot take: :class:`ChunkedCrossEntropy` needs whole logits (not tensor parallelism, which
    shards them over the vocabulary). ``LinearCrossEntropy`` (the loss inside the output head) takes every layout:
    vocabulary-parallel under tensor parallelism, the last stage's head in the schedule's loss under pipeline
    parallelism, each rank's part of the sequences and their targets under context parallelism."""
    settings = cfg.distributed
    tp_size = settings.tp_size if settings is not None else 1
    if loss_fn_named(cfg, CHUNKED) is not None and tp_size > 1:
        return [ConfigIssue("loss_fn._target_", f"ChunkedCrossEntropy upcasts chunks of whole logits, but tp_size "
                            f"{tp_size} shards the logits over the vocabulary; use MaskedCrossEntropy "
                            "(vocabulary-parallel there, and no rank holds whole logits) or tp_size: 1")]
    return []


def chunked_loss_notes(cfg: Config) -> list[str]:
    """The run-start note that ``loss_fn.compile`` governs nothing (see :class:`ChunkedCrossEntropy`)."""
    node = loss_fn_named(cfg, CHUNKED)
    if node is None or not node.to_dict().get("compile", True):
        return []
    return ["note: loss_fn.compile governs nothing: ChunkedCrossEntropy's summed loss (what the engine uses) runs "
            "its chunks eagerly, as upstream's does; only chunk_len acts"]
