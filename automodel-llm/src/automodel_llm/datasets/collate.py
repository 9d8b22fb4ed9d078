"""Collate functions: right-pad token lists into tensors (labels padded with -100): the core's ``pad_collate``
(named here too, as configs and the ``pad_collate`` alias do) and upstream's ``default_collater``."""

from __future__ import annotations

from typing import Any

import torch

from automodel.training.collate import pad_collate
from automodel.training.loss import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "default_collater", "pad_collate"]


def default_collater(batch: list[dict[str, Any]], pad_seq_len_divisible: int | None = None,
                     pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Upstream-compatible name for :func:`pad_collate`."""
    return pad_collate(batch, pad_token_id=pad_token_id, pad_to_multiple_of=pad_seq_len_divisible)
