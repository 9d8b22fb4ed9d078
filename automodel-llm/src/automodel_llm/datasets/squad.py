"""SQuAD-style question answering as prompt + answer, with the loss on the answer tokens only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import Dataset

from automodel.chat_template import resolve_chat_template
from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError
from automodel.hf import load_tokenizer
from automodel_llm.datasets.arguments import (
    ALIASES,
    ARGUMENT_HELP,
    IGNORE_INDEX,
    Padding,
    SampleLength,
    Truncation,
    given,
    learns_nothing,
    raise_problems,
    read_rows,
)
from automodel_llm.datasets.chat import tokenize_conversation


def squad_prompt(context: str, question: str) -> str:
    return f"Context: {context} Question: {question} Answer:"


def answer_text(answers: Any) -> str | None:
    """The first answer of a SQuAD `answers` field ({text: [...]}, a list, or a string); None when it has none."""
    if isinstance(answers, dict):
        texts = answers.get("text") or []
        return texts[0] if texts else None
    if isinstance(answers, list) and answers:
        return answers[0] if isinstance(answers[0], str) else answers[0].get("text")
    return answers if isinstance(answers, str) else None


def tokenize_prompt_answer(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """``<bos> prompt`` then `` answer <eos>``; labels mask the prompt. An EOS the tokenizer puts after every text
    (upstream's ``add_eos_token: true``) ends the sample, not the prompt."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    if prompt_ids and tokenizer.eos_token_id is not None and prompt_ids[-1] == tokenizer.eos_token_id:
        prompt_ids = prompt_ids[:-1]
    answer_ids = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        answer_ids = answer_ids + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids


def tokenize_chat_prompt_answer(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """The prompt as the user's turn and the answer as the assistant's, rendered with the tokenizer's chat
    template; labels keep the assistant turn."""
    return tokenize_conversation(tokenizer, [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}])


def chat_prompt(tokenizer: Any, prompt: str) -> str:
    """The text a chat-trained model is asked: the user's turn and the template's generation prompt."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


class SquadDataset(Dataset):
    """Rows ``{context, question, answers: {text: [...]}}`` (SQuAD's columns) as ``Context: ... Question: ...
    Answer:`` and the first answer, with the loss on the answer. With ``chat_template`` (upstream's argument) the
    prompt is the user's turn and the answer the assistant's, rendered with that template (which becomes the
    tokenizer's, saved with it), the loss on the assistant turn; the exact-match prompts are rendered the same way.

    A row without ``context``, ``question`` or ``answers`` (or with null or non-text ones) is refused, or skipped
    with ``on_bad_row: skip``; a row whose ``answers`` hold no text (an unanswerable SQuAD v2 question) is left
    out, as there is nothing to learn from it.
    """

    argument_aliases = {**ALIASES, "seed": "shuffle_seed"}
    argument_help = {**ARGUMENT_HELP,
                     "path_or_dataset_id": ARGUMENT_HELP["path_or_dataset_id"] + " (default: rajpurkar/squad)",
                     "tokenizer_name_or_path": "a tokenizer for this data set instead of the recipe's",
                     "chat_template": "a Jinja chat template, inline or the path of a file: each row becomes a user "
                                      "turn (the prompt) and an assistant turn (the answer); it becomes the "
                                      "tokenizer's and is saved with it"}

    def __init__(self, path_or_dataset_id: str | None = None, split: str = "train", name: str | None = None,
                 tokenizer_name_or_path: str | None = None, seq_length: int | None = None, tokenizer: Any = None,
                 limit_dataset_samples: int | None = None, shuffle_seed: int | None = None,
                 truncation: Truncation = False, padding: Padding = "do_not_pad", on_bad_row: OnBadRow = "error",
                 dataset_name: str | None = None, max_seq_length: int | None = None, seed: int | None = None,
                 chat_template: str | None = None):
        source = given("path_or_dataset_id", path_or_dataset_id, "dataset_name", dataset_name, "rajpurkar/squad")
        length = SampleLength(given("seq_length", seq_length, "max_seq_length", max_seq_length), truncation, padding)
        shuffle = given("shuffle_seed", shuffle_seed, "seed", seed)
        if tokenizer_name_or_path is not None:
            tokenizer = load_tokenizer(tokenizer_name_or_path, "dataset.tokenizer_name_or_path")
        if tokenizer is None:
            raise AutomodelError("dataset.tokenizer_name_or_path: no tokenizer; name one here or in tokenizer:")
        self.tokenizer = tokenizer
        template = resolve_chat_template(chat_template)
        if template is not None:
            tokenizer.chat_template = template
        tokenize = tokenize_prompt_answer if template is None else tokenize_chat_prompt_answer
        rows = read_rows(source, split, name, shuffle.value, limit_dataset_samples, shuffle.key)
        missing = [c for c in ("context", "question", "answers") if c not in rows.column_names]
        if missing:
            raise AutomodelError(f"{source.key}: '{source.value}' lacks the column(s) {', '.join(missing)} "
                                 f"(found: {', '.join(rows.column_names)})")
        self.samples: list[dict[str, list[int]]] = []
        self.qa_pairs: list[tuple[str, str]] = []
        dropped = 0
        bad_rows = BadRows(on_bad_row, source.value)
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, ("context", "question", "answers")):
                continue
            if not isinstance(row["context"], str) or not isinstance(row["question"], str):
                bad_rows.bad(index, "'context' and 'question' must be text")
                continue
            answer = answer_text(row["answers"])
            if not answer:
                dropped += 1
                continue
            prompt = squad_prompt(row["context"], row["question"])
            ids, labels = tokenize(tokenizer, prompt, answer)
            sample = length.fit(ids, labels, tokenizer.pad_token_id, f"sample {index} of '{source.value}'")
            if learns_nothing(sample["labels"]):
                dropped += 1
                continue
            self.samples.append(sample)
            self.qa_pairs.append((prompt if template is None else chat_prompt(tokenizer, prompt), answer))
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"{source.key}: '{source.value}' (split {split}) has no usable samples: {dropped} "
                                 "rows had no answer or no answer tokens left")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]


def make_squad_dataset(tokenizer: Any, seq_length: int | None = None, limit_dataset_samples: int | None = None,
                       split: str = "train", dataset_name: str | None = None, padding: Padding = False,
                       truncation: Truncation = False, on_bad_row: OnBadRow = "error",
                       path_or_dataset_id: str | None = None, max_seq_length: int | None = None,
                       chat_template: str | None = None, fp8: bool = False) -> SquadDataset:
    """Upstream's factory for ``SquadDataset``, under upstream's argument names (``dataset_name`` here); upstream's
    ``fp8``, which it documents as unused, is accepted false only."""
    raise_problems(_squad_factory_problems({"fp8": fp8}))
    return SquadDataset(path_or_dataset_id=path_or_dataset_id, dataset_name=dataset_name, split=split,
                        tokenizer=tokenizer, seq_length=seq_length, max_seq_length=max_seq_length,
                        limit_dataset_samples=limit_dataset_samples, padding=padding, truncation=truncation,
                        on_bad_row=on_bad_row, chat_template=chat_template)


make_squad_dataset.argument_aliases = ALIASES
def _squad_factory_problems(arguments: Mapping[str, Any]) -> list[tuple[str, str]]:
    if not arguments.get("fp8"):
        return []
    return [("fp8", "upstream's make_squad_dataset documents it as unused and does nothing with it; remove it (FP8 "
                    "training is the fp8: section, not a property of the data)")]


make_squad_dataset.argument_help = {**SquadDataset.argument_help,
                                    "fp8": "upstream documents it as unused: only false (the default) is accepted"}
make_squad_dataset.argument_problems = _squad_factory_problems
