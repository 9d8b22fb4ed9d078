"""Instruction data from any columns: ``column_mapping`` names the context/question/answer columns."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError
from automodel_llm.datasets.arguments import (
    ALIASES,
    ARGUMENT_HELP,
    Padding,
    SampleLength,
    Truncation,
    given,
    learns_nothing,
    read_rows,
)
from automodel_llm.datasets.chat import tokenize_conversation
from automodel_llm.datasets.squad import tokenize_prompt_answer

_ROLES = ("context", "question", "answer")


class ColumnMappedTextInstructionDataset(Dataset):
    """Prompt = the context and question columns, completion = the answer column (the loss on it only by
    default). With ``use_hf_chat_template`` (upstream's) a row is a system turn (the context), a user turn (the
    question) and an assistant turn (the answer), rendered with the tokenizer's chat template as upstream renders
    them (an unmapped context or question an empty turn); the loss on the assistant turn by default.

    A row whose mapped column is null is refused, or skipped with ``on_bad_row: skip``; an empty answer is left out.
    """

    argument_aliases = ALIASES
    argument_help = {**ARGUMENT_HELP,
                     "column_mapping": "role -> column name: context and/or question make the prompt, answer the "
                                       "completion",
                     "answer_only_loss_mask": "the loss on the answer only (false: on the prompt too)",
                     "use_hf_chat_template": "render each row as a system (context), user (question) and assistant "
                                             "(answer) turn with the tokenizer's chat template, which it must have "
                                             "(upstream's); false: the prompt and the answer as plain text"}

    def __init__(self, path_or_dataset_id: str | None = None, column_mapping: dict[str, str] | None = None,
                 split: str = "train", name: str | None = None, tokenizer: Any = None, seq_length: int | None = None,
                 answer_only_loss_mask: bool = True, truncation: Truncation = False, padding: Padding = "do_not_pad",
                 limit_dataset_samples: int | None = None, shuffle_seed: int | None = None,
                 on_bad_row: OnBadRow = "error", dataset_name: str | None = None, max_seq_length: int | None = None,
                 use_hf_chat_template: bool = False):
        source = given("path_or_dataset_id", path_or_dataset_id, "dataset_name", dataset_name)
        length = SampleLength(given("seq_length", seq_length, "max_seq_length", max_seq_length), truncation, padding)
        if not column_mapping:
            raise AutomodelError("dataset.column_mapping: missing (context / question / answer -> column names)")
        if tokenizer is None:
            raise AutomodelError("dataset: ColumnMappedTextInstructionDataset needs a tokenizer (tokenizer: section)")
        unknown = [role for role in column_mapping if role not in _ROLES]
        if unknown:
            raise AutomodelError(f"dataset.column_mapping: unknown role(s) {unknown}; roles are {', '.join(_ROLES)}")
        if "answer" not in column_mapping:
            raise AutomodelError("dataset.column_mapping.answer: required (the column holding the completion)")
        if not {"context", "question"} & set(column_mapping):
            raise AutomodelError("dataset.column_mapping: map at least one of context or question")
        if use_hf_chat_template and not getattr(tokenizer, "chat_template", None):
            raise AutomodelError(f"dataset.use_hf_chat_template: true renders each row with the tokenizer's chat "
                                 f"template, and the tokenizer ('{tokenizer.name_or_path}') has none; use the "
                                 "tokenizer of an instruct/chat model, set tokenizer.chat_template, or set it false")
        rows = read_rows(source, split, name, shuffle_seed, limit_dataset_samples)
        missing = [col for col in column_mapping.values() if col not in rows.column_names]
        if missing:
            raise AutomodelError(f"dataset.column_mapping: '{source.value}' has no column(s) "
                                 f"{', '.join(missing)} (found: {', '.join(rows.column_names)})")
        self.samples: list[dict[str, list[int]]] = []
        self.qa_pairs: list[tuple[str, str]] = []
        bad_rows = BadRows(on_bad_row, source.value)
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, column_mapping.values()):
                continue
            context, question = (str(row[column_mapping[r]]).strip() if r in column_mapping else ""
                                 for r in ("context", "question"))
            answer = str(row[column_mapping["answer"]]).strip()
            if not answer:
                continue
            if use_hf_chat_template:
                turns = [{"role": "system", "content": context}, {"role": "user", "content": question}]
                ids, labels = tokenize_conversation(tokenizer, [*turns, {"role": "assistant", "content": answer}])
                prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            else:
                prompt = " ".join(p for p in (context, question) if p)
                ids, labels = tokenize_prompt_answer(tokenizer, prompt, answer)
            if not answer_only_loss_mask:
                labels = list(ids)
            sample = length.fit(ids, labels, tokenizer.pad_token_id, f"row {index} of '{source.value}'")
            if learns_nothing(sample["labels"]):
                continue
            self.samples.append(sample)
            self.qa_pairs.append((prompt, answer))
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"{source.key}: '{source.value}' (split {split}) has no usable rows: every answer "
                                 "was empty or truncated away")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]
