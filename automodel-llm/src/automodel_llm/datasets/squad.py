"""SQuAD-style question answering as prompt + answer, with the loss on the answer tokens only."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow, load_rows
from automodel.errors import AutomodelError
from automodel.hf import load_tokenizer

IGNORE_INDEX = -100


def squad_prompt(context: str, question: str) -> str:
    return f"Context: {context} Question: {question} Answer:"


def _answer_text(answers: Any) -> str | None:
    if isinstance(answers, dict):
        texts = answers.get("text") or []
        return texts[0] if texts else None
    if isinstance(answers, list) and answers:
        return answers[0] if isinstance(answers[0], str) else answers[0].get("text")
    return answers if isinstance(answers, str) else None


def tokenize_prompt_answer(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """``<bos> prompt`` then `` answer <eos>``; labels mask the prompt."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    answer_ids = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        answer_ids = answer_ids + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids


class SquadDataset(Dataset):
    """Rows ``{context, question, answers: {text: [...]}}`` from a hub name or local file/directory.

    A row without ``context``, ``question`` or ``answers`` (or with null or non-text ones) is refused, or skipped
    with ``on_bad_row: skip``; a row whose ``answers`` hold no text (an unanswerable SQuAD v2 question) is left
    out, as there is nothing to learn from it.
    """

    def __init__(self, dataset_name: str = "rajpurkar/squad", split: str = "train",
                 tokenizer_name_or_path: str | None = None, max_seq_length: int | None = None,
                 tokenizer: Any = None, limit_dataset_samples: int | None = None, truncation: bool = False,
                 seed: int | None = None, on_bad_row: OnBadRow = "error"):
        if tokenizer_name_or_path is not None:
            tokenizer = load_tokenizer(tokenizer_name_or_path, "dataset.tokenizer_name_or_path")
        if tokenizer is None:
            raise AutomodelError("dataset.tokenizer_name_or_path: no tokenizer; name one here or in tokenizer:")
        self.tokenizer = tokenizer
        rows = load_rows(dataset_name, split)
        if limit_dataset_samples is not None:
            rows = rows.select(range(min(limit_dataset_samples, len(rows))))
        missing = [c for c in ("context", "question", "answers") if c not in rows.column_names]
        if missing:
            raise AutomodelError(f"dataset.dataset_name: '{dataset_name}' lacks the column(s) {', '.join(missing)} "
                                 f"(found: {', '.join(rows.column_names)})")
        self.samples: list[dict[str, list[int]]] = []
        self.qa_pairs: list[tuple[str, str]] = []
        dropped = 0
        bad_rows = BadRows(on_bad_row, dataset_name)
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, ("context", "question", "answers")):
                continue
            if not isinstance(row["context"], str) or not isinstance(row["question"], str):
                bad_rows.bad(index, "'context' and 'question' must be text")
                continue
            answer = _answer_text(row["answers"])
            if not answer:
                dropped += 1
                continue
            prompt = squad_prompt(row["context"], row["question"])
            input_ids, labels = tokenize_prompt_answer(tokenizer, prompt, answer)
            if max_seq_length is not None and len(input_ids) > max_seq_length:
                if not truncation:
                    raise AutomodelError(
                        f"dataset.max_seq_length: sample {index} of '{dataset_name}' has {len(input_ids)} tokens, "
                        f"more than {max_seq_length}; raise max_seq_length or set dataset.truncation: true")
                input_ids, labels = input_ids[:max_seq_length], labels[:max_seq_length]
            if all(label == IGNORE_INDEX for label in labels[1:]):
                dropped += 1
                continue
            self.samples.append({"input_ids": input_ids, "labels": labels})
            self.qa_pairs.append((prompt, answer))
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"dataset.dataset_name: '{dataset_name}' (split {split}) has no usable samples: "
                                 f"{dropped} rows had no answer or no answer tokens left")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]


def make_squad_dataset(tokenizer: Any, seq_length: int | None = None, limit_dataset_samples: int | None = None,
                       split: str = "train", dataset_name: str = "rajpurkar/squad", **kwargs: Any) -> SquadDataset:
    """Upstream-compatible factory for :class:`SquadDataset`."""
    return SquadDataset(dataset_name=dataset_name, split=split, tokenizer=tokenizer, max_seq_length=seq_length,
                        limit_dataset_samples=limit_dataset_samples, **kwargs)
