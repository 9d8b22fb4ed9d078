"""HellaSwag (context + four endings + the correct one's index) as single-turn fine-tuning data: the context is the
prompt and the correct ending the completion, with the loss on the ending (upstream's ``HellaSwag``)."""

from __future__ import annotations

import math
from typing import Any

from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError
from automodel_llm.datasets.arguments import IGNORE_INDEX, Given, learns_nothing, read_rows


def context_and_ending(tokenizer: Any, context: str, ending: str) -> tuple[list[int], list[int]]:
    """Upstream's tokenisation: context and ending tokenised apart, a trailing special token of the context (an EOS)
    and a leading one of the ending (a BOS) dropped, then joined; the labels mask the context."""
    all_special = set(tokenizer.all_special_ids)
    context_ids = list(tokenizer(context)["input_ids"])
    ending_ids = list(tokenizer(ending)["input_ids"])
    if context_ids and context_ids[-1] in all_special:
        context_ids = context_ids[:-1]
    if ending_ids and ending_ids[0] in all_special:
        ending_ids = ending_ids[1:]
    return context_ids + ending_ids, [IGNORE_INDEX] * len(context_ids) + ending_ids


class HellaSwag(Dataset):
    """Rows ``{ctx, endings: [...], label}`` (HellaSwag's columns): ``ctx`` followed by ``endings[label]``, the loss
    on the ending. ``pad_to_max_length`` pads every sample to the longest one, rounded up to a multiple of 8 (padding
    masked out of attention and loss); false leaves padding to the collator. A row whose ``label`` is not an index
    of its ``endings`` (HellaSwag's test split has none) is refused, or skipped with ``on_bad_row: skip``."""

    argument_help = {"path_or_dataset": "a hub data set id (Rowan/hellaswag), or a local JSON/JSONL/parquet file",
                     "split": "the split to read", "num_samples_limit": "use only the first N rows",
                     "pad_to_max_length": "pad every sample to the longest one (a multiple of 8)"}

    def __init__(self, path_or_dataset: str, tokenizer: Any = None, split: str = "train",
                 num_samples_limit: int | None = None, pad_to_max_length: bool = True,
                 on_bad_row: OnBadRow = "error"):
        if tokenizer is None:
            raise AutomodelError("dataset: HellaSwag needs the recipe's tokenizer (tokenizer: or model:)")
        rows = read_rows(Given(path_or_dataset, "dataset.path_or_dataset"), split, limit=num_samples_limit)
        bad_rows = BadRows(on_bad_row, path_or_dataset)
        self.samples: list[dict[str, list[int]]] = []
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, ("ctx", "endings", "label")):
                continue
            endings, label = row["endings"], row["label"]
            try:
                ending = endings[int(label)]
            except (TypeError, ValueError, IndexError):
                bad_rows.bad(index, f"'label' ({label!r}) is not an index of 'endings'")
                continue
            ids, labels = context_and_ending(tokenizer, str(row["ctx"]), str(ending))
            if not learns_nothing(labels):
                self.samples.append({"input_ids": ids, "labels": labels})
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"dataset.path_or_dataset: '{path_or_dataset}' (split {split}) has no usable rows")
        if pad_to_max_length:
            self._pad(tokenizer.pad_token_id or 0)

    def _pad(self, pad_id: int) -> None:
        length = math.ceil(max(len(s["input_ids"]) for s in self.samples) / 8) * 8
        for sample in self.samples:
            missing = length - len(sample["input_ids"])
            sample["attention_mask"] = [1] * len(sample["input_ids"]) + [0] * missing
            sample["input_ids"] = sample["input_ids"] + [pad_id] * missing
            sample["labels"] = sample["labels"] + [IGNORE_INDEX] * missing

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]
