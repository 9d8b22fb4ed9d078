"""Pre-training text: a ``text`` column tokenized, joined with EOS and cut into fixed-length blocks."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow, load_rows
from automodel.errors import AutomodelError


class PretrainingTextDataset(Dataset):
    """Blocks of ``seq_length`` tokens; every token is a label. The tail shorter than a block is dropped.

    A row whose text is null or not text is refused, or skipped with ``on_bad_row: skip``; empty text adds nothing.
    """

    def __init__(self, path_or_dataset_id: str, split: str = "train", tokenizer: Any = None, seq_length: int = 512,
                 text_column: str = "text", limit_dataset_samples: int | None = None,
                 on_bad_row: OnBadRow = "error"):
        if tokenizer is None:
            raise AutomodelError("dataset: PretrainingTextDataset needs a tokenizer (tokenizer: section)")
        rows = load_rows(path_or_dataset_id, split, key="dataset.path_or_dataset_id")
        if limit_dataset_samples is not None:
            rows = rows.select(range(min(limit_dataset_samples, len(rows))))
        if text_column not in rows.column_names:
            raise AutomodelError(f"dataset.text_column: '{path_or_dataset_id}' has no column '{text_column}' "
                                 f"(found: {', '.join(rows.column_names)})")
        stream: list[int] = []
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        bad_rows = BadRows(on_bad_row, path_or_dataset_id)
        for index, text in enumerate(rows[text_column]):
            if not isinstance(text, str):
                bad_rows.bad(index, f"the field '{text_column}' is " + ("null" if text is None else "not text"))
            elif text:
                stream += tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        bad_rows.report()
        count = len(stream) // seq_length
        if count == 0:
            raise AutomodelError(f"dataset.path_or_dataset_id: '{path_or_dataset_id}' has {len(stream)} tokens, fewer "
                                 f"than one block of seq_length={seq_length}")
        self.blocks = torch.tensor(stream[: count * seq_length], dtype=torch.long).view(count, seq_length)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        block = self.blocks[index].tolist()
        return {"input_ids": block, "labels": block}


class MockDataset(Dataset):
    """Random token sequences of a fixed length, for benchmarks (seeded, so runs are comparable)."""

    def __init__(self, num_samples: int = 1024, seq_length: int = 128, vocab_size: int | None = None,
                 tokenizer: Any = None, seed: int = 0):
        vocab = vocab_size or (len(tokenizer) if tokenizer is not None else None)
        if not vocab:
            raise AutomodelError("dataset.vocab_size: needed when no tokenizer is available")
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (num_samples, seq_length), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        row = self.data[index].tolist()
        return {"input_ids": row, "labels": row}
