"""Padding tokenised rows into a batch: the collate every domain uses for samples that are token lists already."""

from __future__ import annotations

from typing import Any

import torch

from automodel.training.loss import IGNORE_INDEX


def pad_collate(batch: list[dict[str, Any]], pad_token_id: int = 0, pad_to_multiple_of: int | None = None
                ) -> dict[str, torch.Tensor]:
    """Stack samples of ``input_ids``/``labels`` (and optional ``attention_mask``, ``position_ids``, an
    encoder-decoder's ``decoder_input_ids`` and a BERT-style pair's ``token_type_ids``), each key right-padded to
    its longest in the batch (rounded up to ``pad_to_multiple_of``); labels padded with ``IGNORE_INDEX``: a causal
    sample's keys are one length, an encoder-decoder's target (``labels``, ``decoder_input_ids``) is its own."""
    out: dict[str, torch.Tensor] = {}
    fills = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0, "position_ids": 0,
             "decoder_input_ids": pad_token_id, "token_type_ids": 0}
    for key, fill in fills.items():
        if key not in batch[0] and key != "attention_mask":
            continue
        values = [sample[key] if key in sample else [1] * len(sample["input_ids"]) for sample in batch]
        longest = max(len(row) for row in values)
        if pad_to_multiple_of:
            longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
        rows = torch.full((len(batch), longest), fill, dtype=torch.long)
        for i, row in enumerate(values):
            rows[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        out[key] = rows
    return out
