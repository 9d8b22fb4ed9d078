"""Chat data: a ``messages`` column rendered with the tokenizer's chat template; loss on assistant turns only."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow, load_rows
from automodel.errors import AutomodelError

IGNORE_INDEX = -100


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    result = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(result, dict) or hasattr(result, "keys"):
        result = result["input_ids"]
    return list(result)


def tokenize_conversation(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels that keep only the assistant turns.

    Each assistant turn's tokens are the difference between the conversation rendered through that turn and
    rendered up to it with the generation prompt, so any template whose renders extend each other works.
    """
    ids = _render(tokenizer, messages, generation_prompt=False)
    labels = [IGNORE_INDEX] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], generation_prompt=True))
        end = len(_render(tokenizer, messages[: i + 1], generation_prompt=False))
        labels[start:end] = ids[start:end]
    return ids, labels


class ChatDataset(Dataset):
    """Rows with a list of ``{role, content}`` messages (``messages`` column by default).

    A row whose messages are null, not a list of mappings, or hold no assistant turn is refused, or skipped with
    ``on_bad_row: skip``.
    """

    def __init__(self, path_or_dataset_id: str, split: str = "train", tokenizer: Any = None,
                 seq_length: int | None = None, messages_column: str = "messages", truncation: bool = False,
                 limit_dataset_samples: int | None = None, on_bad_row: OnBadRow = "error"):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise AutomodelError("tokenizer: ChatDataset needs a tokenizer with a chat_template")
        rows = load_rows(path_or_dataset_id, split, key="dataset.path_or_dataset_id")
        if limit_dataset_samples is not None:
            rows = rows.select(range(min(limit_dataset_samples, len(rows))))
        if messages_column not in rows.column_names:
            raise AutomodelError(f"dataset.messages_column: '{path_or_dataset_id}' has no column '{messages_column}' "
                                 f"(found: {', '.join(rows.column_names)})")
        self.samples: list[dict[str, list[int]]] = []
        bad_rows = BadRows(on_bad_row, path_or_dataset_id)
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, (messages_column,)):
                continue
            messages = row[messages_column]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                bad_rows.bad(index, f"'{messages_column}' must be a list of {{role, content}} messages")
                continue
            if not any(m.get("role") == "assistant" for m in messages):
                bad_rows.bad(index, "the conversation has no assistant turn to learn from")
                continue
            ids, labels = tokenize_conversation(tokenizer, messages)
            if seq_length is not None and len(ids) > seq_length:
                if not truncation:
                    raise AutomodelError(f"dataset.seq_length: conversation {index} has {len(ids)} tokens, more than "
                                         f"{seq_length}; raise seq_length or set dataset.truncation: true")
                ids, labels = ids[:seq_length], labels[:seq_length]
            if all(label == IGNORE_INDEX for label in labels[1:]):
                continue
            self.samples.append({"input_ids": ids, "labels": labels})
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"dataset.path_or_dataset_id: '{path_or_dataset_id}' has no conversation with "
                                 "assistant tokens left")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]
