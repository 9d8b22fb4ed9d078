"""Sequence classification data: one text or a pair of texts and a class label per row (GLUE-style), tokenized for
the sequence-classification recipe (:mod:`automodel_llm.seq_cls`); upstream's ``GLUE_MRPC`` and its mock data set.

A sample is ``{input_ids, attention_mask, labels: [label]}``: the label as a one-element list, so the padding
collate functions (``pad_collate``, upstream's ``default_collater``) stack a batch's labels into ``[B, 1]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError
from automodel_llm.datasets.arguments import Given, read_rows

GLUE = "nyu-mll/glue"  # the hub's GLUE (parquet files, no loading script), what upstream's "glue" resolves to
_LONGEST_DEFAULT = 1024  # max_length null and a tokenizer without a real limit (model_max_length 1e30): upstream's cap


def _text_fields(value: str | list[str]) -> list[str]:
    fields = [value] if isinstance(value, str) else list(value)
    if not 1 <= len(fields) <= 2 or not all(isinstance(f, str) and f for f in fields):
        raise AutomodelError(f"dataset.text_fields: one column name or a pair of them (sentence pairs), found "
                             f"{value!r}")
    return fields


def _max_length(max_length: int | None, tokenizer: Any) -> int:
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise AutomodelError(f"dataset.max_length: expected an integer >= 2, found {max_length!r}")
        return max_length
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit <= 8192 else _LONGEST_DEFAULT


class _LabelledSamples(Dataset):
    """Samples ``{input_ids, attention_mask, labels: [label]}`` held in a list."""

    samples: list[dict[str, list[int]]]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]

    @property
    def largest_label(self) -> int:
        """The largest class label of the samples (the recipe checks it against the model's head)."""
        return max(sample["labels"][0] for sample in self.samples)


class SequenceClassificationDataset(_LabelledSamples):
    """Rows with one text column (``text_fields: text``) or a pair (``[sentence1, sentence2]``) and an integer class
    label (``label_field``), from a hub data set or a local JSON/JSONL/CSV/parquet file; each row is tokenized as
    the model's tokenizer encodes a text (pair) for classification (special tokens, a pair's separator), cut to
    ``max_length`` tokens. A row without a label in ``0 .. num_labels - 1`` (GLUE's test splits carry -1) is
    refused, or left out with ``on_bad_row: skip``; the recipe checks the labels against the model's head."""

    argument_help = {
        "path_or_dataset_id": "a hub data set id (nyu-mll/glue with name: sst2, ...) or a local "
                              "JSON/JSONL/CSV/parquet file or directory",
        "name": "the subset of a hub data set (GLUE's task: mrpc, sst2, ...)",
        "split": "the split to read",
        "text_fields": "the text column, or the two columns of a sentence pair (default text)",
        "label_field": "the column of integer class labels 0 .. num_labels - 1 (default label)",
        "max_length": "tokens per sample, longer ones cut (null: the tokenizer's limit, at most 1024; default 256)",
        "num_samples_limit": "use only the first N rows",
    }

    def __init__(self, path_or_dataset_id: str, tokenizer: Any = None, split: str = "train", name: str | None = None,
                 text_fields: str | list[str] = "text", label_field: str = "label", max_length: int | None = 256,
                 num_samples_limit: int | None = None, on_bad_row: OnBadRow = "error"):
        if tokenizer is None:
            raise AutomodelError("dataset: sequence classification rows are text; the recipe needs a tokenizer "
                                 "(tokenizer: or the model's own)")
        fields = _text_fields(text_fields)
        rows = read_rows(Given(path_or_dataset_id, "dataset.path_or_dataset_id"), split, name=name,
                         limit=num_samples_limit)
        length = _max_length(max_length, tokenizer)
        columns = getattr(rows, "column_names", None) or []
        absent = [f for f in (*fields, label_field) if columns and f not in columns]
        if absent:
            raise AutomodelError(f"dataset: '{path_or_dataset_id}' (split {split}) has no column "
                                 f"{', '.join(map(repr, absent))}; its columns: {', '.join(columns)} (set "
                                 "dataset.text_fields / label_field)")
        bad_rows = BadRows(on_bad_row, str(path_or_dataset_id))
        self.samples = []
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, (*fields, label_field)):
                continue
            label = row[label_field]
            if isinstance(label, bool) or not isinstance(label, int) or label < 0:
                bad_rows.bad(index, f"'{label_field}' is {label!r}, not a class index 0, 1, ... (a test split "
                                    "without labels?)")
                continue
            texts = [str(row[f]) for f in fields]
            encoded = tokenizer(*texts, truncation=True, max_length=length)
            self.samples.append({"input_ids": list(encoded["input_ids"]),
                                 "attention_mask": list(encoded.get("attention_mask") or
                                                        [1] * len(encoded["input_ids"])),
                                 "labels": [label]})
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"dataset.path_or_dataset_id: '{path_or_dataset_id}' (split {split}) has no usable "
                                 "rows")


def glue_mrpc(tokenizer: Any = None, split: str = "train", num_samples_limit: int | None = None,
              trust_remote_code: bool = False, max_length: int | None = 256) -> SequenceClassificationDataset:
    """GLUE MRPC (upstream's ``GLUE_MRPC``): sentence pairs labelled 1 when they paraphrase each other."""
    del trust_remote_code  # only false is accepted (validation): GLUE's hub files are parquet, no script runs
    return SequenceClassificationDataset(GLUE, tokenizer, split=split, name="mrpc",
                                         text_fields=["sentence1", "sentence2"], max_length=max_length,
                                         num_samples_limit=num_samples_limit)


def _glue_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
    if kwargs.get("trust_remote_code"):
        return {"trust_remote_code": "true would let datasets run a loading script; GLUE on the hub (nyu-mll/glue) "
                                     "is parquet files, read without running any code: remove it"}
    return {}


glue_mrpc.automodel_config_issues = _glue_issues  # type: ignore[attr-defined]
glue_mrpc.argument_help = {  # type: ignore[attr-defined]
    "split": "train, validation or test (the test split has no labels)",
    "num_samples_limit": "use only the first N rows",
    "max_length": "tokens per sentence pair, longer ones cut (null: the tokenizer's limit, at most 1024)",
    "trust_remote_code": "false only: GLUE's hub files are parquet, nothing runs"}


class MockSequenceClassificationDataset(_LabelledSamples):
    """Random token ids of random lengths (4 .. ``max_seq_len``) with random labels below ``num_labels``, seeded
    (upstream's mock data set of its sequence-classification tests): token ids already, so no tokenizer is needed."""

    pretokenized = True
    argument_help = {"num_samples": "how many samples (default 64)", "num_labels": "labels are drawn below it",
                     "vocab_size": "token ids are drawn below it", "max_seq_len": "the longest sample (at least 4)",
                     "seed": "the random generator's seed"}

    def __init__(self, num_samples: int = 64, num_labels: int = 2, vocab_size: int = 256, max_seq_len: int = 32,
                 seed: int = 0, tokenizer: Any = None):
        del tokenizer  # upstream passes it and does not read it: the samples are token ids
        for key, value, least in (("num_samples", num_samples, 1), ("num_labels", num_labels, 2),
                                  ("vocab_size", vocab_size, 2), ("max_seq_len", max_seq_len, 4)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise AutomodelError(f"dataset.{key}: expected an integer >= {least}, found {value!r}")
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, max_seq_len + 1, (num_samples,), generator=generator).tolist()
        labels = torch.randint(0, num_labels, (num_samples,), generator=generator).tolist()
        self.samples = [{"input_ids": torch.randint(0, vocab_size, (n,), generator=generator).tolist(),
                         "attention_mask": [1] * n, "labels": [label]}
                        for n, label in zip(lengths, labels, strict=True)]
