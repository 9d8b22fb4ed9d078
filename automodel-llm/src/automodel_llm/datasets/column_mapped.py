"""Instruction data from any columns: ``column_mapping`` names the context/question/answer columns."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow, load_rows
from automodel.errors import AutomodelError

IGNORE_INDEX = -100
_ROLES = ("context", "question", "answer")


def _fits(ids: list[int], labels: list[int], limit: int | None, truncate: bool, where: str, key: str
          ) -> tuple[list[int], list[int]]:
    if limit is None or len(ids) <= limit:
        return ids, labels
    if not truncate:
        raise AutomodelError(f"{key}.seq_length: {where} has {len(ids)} tokens, more than {limit}; raise "
                             f"seq_length or set {key}.truncation: true")
    return ids[:limit], labels[:limit]


class ColumnMappedTextInstructionDataset(Dataset):
    """Prompt = context and question columns, completion = the answer column (loss on it only by default).

    A row whose mapped column is null is refused, or skipped with ``on_bad_row: skip``; an empty answer is left out.
    """

    def __init__(self, path_or_dataset_id: str, column_mapping: dict[str, str], split: str = "train",
                 tokenizer: Any = None, seq_length: int | None = None, answer_only_loss_mask: bool = True,
                 truncation: bool | str = False, padding: str | bool = "do_not_pad",
                 limit_dataset_samples: int | None = None, start_of_turn_token: str | None = None,
                 name: str | None = None, on_bad_row: OnBadRow = "error"):
        if tokenizer is None:
            raise AutomodelError("dataset: ColumnMappedTextInstructionDataset needs a tokenizer (tokenizer: section)")
        unknown = [role for role in column_mapping if role not in _ROLES]
        if unknown:
            raise AutomodelError(f"dataset.column_mapping: unknown role(s) {unknown}; roles are {', '.join(_ROLES)}")
        if "answer" not in column_mapping:
            raise AutomodelError("dataset.column_mapping.answer: required (the column holding the completion)")
        if not {"context", "question"} & set(column_mapping):
            raise AutomodelError("dataset.column_mapping: map at least one of context or question")
        rows = load_rows(path_or_dataset_id, split, key="dataset.path_or_dataset_id")
        if limit_dataset_samples is not None:
            rows = rows.select(range(min(limit_dataset_samples, len(rows))))
        missing = [col for col in column_mapping.values() if col not in rows.column_names]
        if missing:
            raise AutomodelError(f"dataset.column_mapping: '{path_or_dataset_id}' has no column(s) "
                                 f"{', '.join(missing)} (found: {', '.join(rows.column_names)})")
        truncate = truncation not in (False, None, "do_not_truncate")
        self.samples: list[dict[str, list[int]]] = []
        self.qa_pairs: list[tuple[str, str]] = []
        bad_rows = BadRows(on_bad_row, path_or_dataset_id)
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, column_mapping.values()):
                continue
            parts = [str(row[column_mapping[r]]).strip() for r in ("context", "question") if r in column_mapping]
            prompt = " ".join(p for p in parts if p)
            answer = str(row[column_mapping["answer"]]).strip()
            if not answer:
                continue
            prompt_ids = tokenizer(prompt)["input_ids"]
            answer_ids = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
            if tokenizer.eos_token_id is not None:
                answer_ids = answer_ids + [tokenizer.eos_token_id]
            ids = prompt_ids + answer_ids
            labels = ([IGNORE_INDEX] * len(prompt_ids) if answer_only_loss_mask else list(prompt_ids)) + answer_ids
            ids, labels = _fits(ids, labels, seq_length, truncate, f"row {index} of '{path_or_dataset_id}'",
                                "dataset")
            if all(label == IGNORE_INDEX for label in labels[1:]):
                continue
            self.samples.append({"input_ids": ids, "labels": labels})
            self.qa_pairs.append((prompt, answer))
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"dataset.path_or_dataset_id: '{path_or_dataset_id}' (split {split}) has no usable "
                                 "rows: every answer was empty or truncated away")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]
