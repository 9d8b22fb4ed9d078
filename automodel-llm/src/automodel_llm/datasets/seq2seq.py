"""Source -> target pairs for an encoder-decoder model (T5, BART): upstream's ``make_seq2seq_dataset``.

An encoder-decoder batch is laid out unlike a causal one: the encoder reads the source (``input_ids`` with its
``attention_mask``); ``labels`` are the target tokens themselves, not shifted, so the loss pairs ``logits[i]`` with
``labels[i]``; the decoder reads ``decoder_input_ids``, the labels shifted right by one behind the decoder's start
token (teacher forcing). Transformers builds those decoder inputs itself only when it is handed the labels, which
the recipe keeps for its own loss, so the data set builds them.
"""

from __future__ import annotations

import string
from typing import Any

from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError
from automodel_llm.datasets.arguments import ALIASES, ARGUMENT_HELP, Truncation, given, read_rows
from automodel_llm.datasets.squad import answer_text

SQUAD_SOURCE = "question: {question}  context: {context}"  # upstream's default source_template


def shift_right(labels: list[int], decoder_start_token_id: int) -> list[int]:
    """The decoder's inputs for ``labels``: the start token, then every label but the last (position ``i`` reads
    what comes before ``labels[i]`` and predicts it)."""
    return [decoder_start_token_id, *labels[:-1]]


def _template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


class Seq2SeqDataset(Dataset):
    """Each row becomes a source (``source_template`` filled from the row's columns, or the column ``source_key``)
    and a target (the column ``target_key``: text, or SQuAD's ``answers``, whose first answer is taken). Samples
    hold ``input_ids`` / ``attention_mask`` (the source), ``labels`` (the target, unshifted) and
    ``decoder_input_ids`` (the labels shifted right behind ``decoder_start_token_id``; default the tokenizer's pad
    id, T5's start token; BART starts from its EOS, so set it there: the run refuses a value the model does not
    use). A row lacking a column, or with an empty target, is refused or skipped (``on_bad_row``)."""

    argument_aliases = ALIASES
    argument_help = {
        **ARGUMENT_HELP,
        "path_or_dataset_id": ARGUMENT_HELP["path_or_dataset_id"] + " (default: rajpurkar/squad)",
        "seq_length": "token limit of the source and of the target: a longer one is refused, or cut when "
                      "truncation is on (the default)",
        "source_template": "the source text: a Python format string filled from the row's columns; null: the "
                           "column source_key as it is",
        "source_key": "the column that is the source when source_template is null",
        "target_key": "the column that is the target: text, or SQuAD's answers (the first answer)",
        "decoder_start_token_id": "the token the decoder starts from (default: the tokenizer's pad id, T5's); "
                                  "it must be the model's decoder_start_token_id",
    }

    def __init__(self, tokenizer: Any, seq_length: int | None = None, limit_dataset_samples: int | None = None,
                 split: str = "train", dataset_name: str | None = None, source_template: str | None = SQUAD_SOURCE,
                 source_key: str = "question", target_key: str = "answers",
                 decoder_start_token_id: int | None = None, truncation: Truncation = True,
                 path_or_dataset_id: str | None = None, max_seq_length: int | None = None, name: str | None = None,
                 shuffle_seed: int | None = None, on_bad_row: OnBadRow = "error"):
        source = given("path_or_dataset_id", path_or_dataset_id, "dataset_name", dataset_name, "rajpurkar/squad")
        length = given("seq_length", seq_length, "max_seq_length", max_seq_length)
        if tokenizer is None:
            raise AutomodelError("tokenizer: make_seq2seq_dataset needs the run's tokenizer; set tokenizer: or "
                                 "model.pretrained_model_name_or_path")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise AutomodelError("tokenizer: has neither a pad nor an EOS token, which pad the batches' token ids")
        self.pad_token_id = pad
        self.decoder_start_token_id = pad if decoder_start_token_id is None else decoder_start_token_id
        rows = read_rows(source, split, name, shuffle_seed, limit_dataset_samples)
        fields = _template_fields(source_template) if source_template is not None else [source_key]
        missing = [c for c in (*fields, target_key) if c not in rows.column_names]
        if missing:
            raise AutomodelError(f"{source.key}: '{source.value}' lacks the column(s) {', '.join(missing)} that "
                                 "dataset.source_template / source_key / target_key name (found: "
                                 f"{', '.join(rows.column_names)})")
        cut = bool(truncation) and truncation != "do_not_truncate"
        self.samples: list[dict[str, list[int]]] = []
        bad_rows = BadRows(on_bad_row, source.value)
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, (*fields, target_key)):
                continue
            text = source_template.format(**row) if source_template is not None else str(row[source_key])
            target = answer_text(row[target_key])
            if not target or not target.strip():
                bad_rows.bad(index, f"the target '{target_key}' holds no text")
                continue
            sample = self._tokenize(tokenizer, text, target.strip(), length.value, cut)
            if max(len(sample["input_ids"]), len(sample["labels"])) > (length.value or float("inf")):
                raise AutomodelError(f"{length.key}: row {index + 1} of '{source.value}' is longer than "
                                     f"{length.value} tokens; raise it, or set dataset.truncation: true")
            self.samples.append(sample)
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"{source.key}: '{source.value}' (split {split}) has no usable rows")

    def _tokenize(self, tokenizer: Any, source: str, target: str, limit: int | None, cut: bool
                  ) -> dict[str, list[int]]:
        cap = {"max_length": limit, "truncation": True} if cut and limit else {}
        encoded = tokenizer(source, **cap)
        labels = list(tokenizer(text_target=target, **cap)["input_ids"])
        return {"input_ids": list(encoded["input_ids"]), "attention_mask": list(encoded["attention_mask"]),
                "labels": labels, "decoder_input_ids": shift_right(labels, self.decoder_start_token_id)}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]
