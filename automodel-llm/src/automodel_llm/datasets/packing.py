"""Packed sequences: several samples per row, positions restarting per sample, attention kept inside each.

Rows carry ``position_ids`` and no ``attention_mask``: transformers then derives a block-diagonal causal mask
from the position restarts (sdpa, eager and flash attention alike). Each sample's first label is masked, so
no token learns to predict across a sample boundary and the loss equals the unpacked loss of the same samples;
samples whose labels are the next tokens already (the data set's ``labels_shifted``) keep every label, since each
pairs with its own position.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from automodel.errors import AutomodelError

IGNORE_INDEX = -100


class PackedDataset(Dataset):
    """First-fit packing of a tokenized dataset into rows of at most ``pack_size`` tokens.

    Each sample goes into the first of the most recent ``open_rows`` rows that has room, so short samples fill
    the gaps long ones leave; samples are never reordered within a row.
    """

    def __init__(self, dataset: Any, pack_size: int, split_across_pack: bool = False, max_packs: int | None = None,
                 open_rows: int = 64):
        if pack_size < 2:
            raise AutomodelError(f"packed_sequence.packed_sequence_size must be >= 2, found {pack_size}")
        self.pack_size = pack_size
        self.labels_shifted = bool(getattr(dataset, "labels_shifted", False))  # the loss reads it as the source's
        # where the loss shifts, a sample's first label would be predicted from the token before it, another sample's
        first = 0 if self.labels_shifted else 1
        self.rows: list[dict[str, list[int]]] = []
        first_open = 0
        for index in range(len(dataset)):
            sample = dataset[index]
            ids, labels = list(sample["input_ids"]), [IGNORE_INDEX] * first + list(sample["labels"])[first:]
            if len(ids) > pack_size and not split_across_pack:
                raise AutomodelError(f"packed_sequence.packed_sequence_size: sample {index} has {len(ids)} tokens, "
                                     f"more than {pack_size}; raise the size or set split_across_pack: true")
            for start in range(0, len(ids), pack_size):
                piece_ids, piece_labels = ids[start:start + pack_size], labels[start:start + pack_size]
                if start:
                    piece_labels = [IGNORE_INDEX] * first + piece_labels[first:]
                first_open = max(first_open, len(self.rows) - open_rows)
                row = next((r for r in self.rows[first_open:] if len(r["input_ids"]) + len(piece_ids) <= pack_size),
                           None)
                if row is None:
                    row = {"input_ids": [], "labels": [], "position_ids": []}
                    self.rows.append(row)
                row["input_ids"] += piece_ids
                row["labels"] += piece_labels
                row["position_ids"] += list(range(len(piece_ids)))
            if max_packs is not None and len(self.rows) > max_packs:
                break
        if max_packs is not None:
            self.rows = self.rows[:max_packs]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index]


def packed_collate(batch: list[dict[str, list[int]]], pack_size: int, pad_token_id: int = 0
                   ) -> dict[str, torch.Tensor]:
    """Stack packed rows padded to ``pack_size``; the padding is its own (label-free) segment."""
    size = len(batch)
    input_ids = torch.full((size, pack_size), pad_token_id, dtype=torch.long)
    labels = torch.full((size, pack_size), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((size, pack_size), dtype=torch.long)
    token_count = torch.zeros(size, dtype=torch.long)
    for i, row in enumerate(batch):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.as_tensor(row["input_ids"])
        labels[i, :n] = torch.as_tensor(row["labels"])
        position_ids[i, :n] = torch.as_tensor(row["position_ids"])
        position_ids[i, n:] = torch.arange(pack_size - n)
        token_count[i] = n
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "token_count": token_count}
