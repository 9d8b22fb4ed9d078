"""Token-weighted losses. The engine divides a step's summed loss by the step's label-token count."""

from __future__ import annotations

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
    """A loss that returns the sum over label tokens, computed in float32: ours (which upcasts itself, as its
    ``fp32_upcast`` says), or another switched to ``reduction='sum'`` and wrapped in ``Float32Loss``."""
    if loss_fn is None:
        return MaskedCrossEntropy()
    if isinstance(loss_fn, MaskedCrossEntropy):
        return loss_fn
    if hasattr(loss_fn, "reduction"):
        loss_fn.reduction = "sum"
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        loss_fn.ignore_index = IGNORE_INDEX
    return Float32Loss(loss_fn)

