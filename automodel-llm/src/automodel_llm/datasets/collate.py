"""Collate functions: right-pad token lists into tensors (labels padded with -100)."""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100


def pad_collate(batch: list[dict[str, Any]], pad_token_id: int = 0, pad_to_multiple_of: int | None = None
                ) -> dict[str, torch.Tensor]:
    """Stack samples of ``input_ids``/``labels`` (and optional ``position_ids``) padded to the longest."""
    longest = max(len(sample["input_ids"]) for sample in batch)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    out: dict[str, torch.Tensor] = {}
    fills = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0, "position_ids": 0}
    for key, fill in fills.items():
        if key not in batch[0] and key != "attention_mask":
            continue
        rows = torch.full((len(batch), longest), fill, dtype=torch.long)
        for i, sample in enumerate(batch):
            values = sample.get(key) if key != "attention_mask" or key in sample else [1] * len(sample["input_ids"])
            rows[i, : len(values)] = torch.as_tensor(values, dtype=torch.long)
        out[key] = rows
    return out


def default_collater(batch: list[dict[str, Any]], pad_seq_len_divisible: int | None = None,
                     pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Upstream-compatible name for :func:`pad_collate`."""
    return pad_collate(batch, pad_token_id=pad_token_id, pad_to_multiple_of=pad_seq_len_divisible)
