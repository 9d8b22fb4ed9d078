"""Retrieval data: JSONL rows ``{query, positive | positives, negatives}`` read through ``datasets``.

A document is a string, or a mapping with ``text`` (and optionally ``title``, prepended). ``positive`` may be one
document or a list; ``positives`` a list; ``negatives`` (hard negatives) is optional. Each (query, positive) pair is
one training example (``expand_positives``), carrying every positive of its query so that none of them is ever
treated as a negative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from automodel.data import BadRows, OnBadRow, load_rows
from automodel.errors import AutomodelError
from automodel_retrieval.negatives import text_key

INSTRUCTIONS = ("query_instruction", "passage_instruction")


def doc_text(value: Any, key: str = "document") -> str:
    """A document's text: the string itself, or ``title`` + ``text`` of a mapping."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        title = value.get("title")
        return f"{title} {value['text']}" if isinstance(title, str) and title else value["text"]
    raise AutomodelError(f"{key}: a document must be a string or a mapping with 'text', found {value!r}")


def _documents(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [doc_text(v, key) for v in value if v is not None]
    return [doc_text(value, key)]


def row_positives(row: dict[str, Any], key: str = "dataset") -> list[str]:
    positives = _documents(row.get("positives"), f"{key}.positives") + _documents(row.get("positive"),
                                                                                   f"{key}.positive")
    return list(dict.fromkeys(positives))


def row_negatives(row: dict[str, Any], key: str = "dataset") -> list[str]:
    return _documents(row.get("negatives"), f"{key}.negatives")


def load_corpus(name_or_path: str, key: str = "corpus") -> list[str]:
    """Documents from a ``.txt`` file (one per line) or a JSON/JSONL/CSV/parquet file (a ``text`` column)."""
    path = Path(str(name_or_path))
    if path.suffix.lower() == ".txt":
        if not path.is_file():
            raise AutomodelError(f"{key}: '{path}' does not exist")
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = load_rows(name_or_path, "train", key)
    if "text" not in rows.column_names:
        raise AutomodelError(f"{key}: '{name_or_path}' has no 'text' column (found: {', '.join(rows.column_names)})")
    return [doc_text(row, key) for row in rows]


class RetrievalDataset(torch.utils.data.Dataset):
    """(query, positive, negatives) examples for bi-encoder and cross-encoder training.

    Validation uses ``queries``, ``corpus`` and ``positive_ids``: each query is ranked against the whole corpus
    (``corpus`` file documents plus every document the rows mention). A row without a text query or without a
    positive is refused, or skipped with ``on_bad_row: skip``.
    """

    def __init__(self, path: str | None = None, *, dataset_name: str | None = None, split: str = "train",
                 corpus: str | None = None, num_negatives: int | None = None, expand_positives: bool = True,
                 limit_dataset_samples: int | None = None, query_field: str = "query",
                 on_bad_row: OnBadRow = "error"):
        source = path or dataset_name
        if not source:
            raise AutomodelError("dataset.path: missing (a JSONL file of {query, positive(s), negatives} rows)")
        self._read(load_rows(source, split, "dataset.path"), source, corpus, num_negatives, expand_positives,
                   limit_dataset_samples, query_field, on_bad_row)

    @classmethod
    def from_rows(cls, rows: Any, source: str, num_negatives: int | None = None,
                  expand_positives: bool = True) -> RetrievalDataset:
        """The data set of already loaded rows (``source``: what errors name)."""
        dataset = cls.__new__(cls)
        dataset._read(rows, source, None, num_negatives, expand_positives, None, "query", "error")
        return dataset

    def _read(self, rows: Any, source: str, corpus: str | None, num_negatives: int | None, expand_positives: bool,
              limit_dataset_samples: int | None, query_field: str, on_bad_row: OnBadRow) -> None:
        if num_negatives is not None and num_negatives < 0:
            raise AutomodelError(f"dataset.num_negatives: must be >= 0, found {num_negatives}")
        if query_field not in rows.column_names:
            raise AutomodelError(f"dataset.query_field: '{source}' has no '{query_field}' column (found: "
                                 f"{', '.join(rows.column_names)})")
        if limit_dataset_samples is not None:
            rows = rows.select(range(min(limit_dataset_samples, len(rows))))
        documents: dict[str, int] = {}
        if corpus is not None:
            for text in load_corpus(corpus, "dataset.corpus"):
                documents.setdefault(text, len(documents))
        self.queries: list[str] = []
        self.positive_ids: list[set[int]] = []
        self.examples: list[dict[str, Any]] = []
        # rows may carry their source's instructions (upstream's corpus metadata: upstream.retrieval_dataset)
        self.query_instructions: list[str] = []
        self.document_instructions: dict[str, str] = {}
        bad_rows = BadRows(on_bad_row, source)
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, (query_field,)):
                continue
            query = row[query_field]
            if not isinstance(query, str):
                bad_rows.bad(index, f"the field '{query_field}' is not text")
                continue
            positives = row_positives(row, f"dataset row {index + 1}")
            if not positives:
                bad_rows.bad(index, "it has no 'positive' or 'positives'")
                continue
            negatives = [n for n in row_negatives(row, f"dataset row {index}") if n not in positives]
            if num_negatives is not None:
                negatives = negatives[:num_negatives]
            instructions = {k: row.get(k) or "" for k in INSTRUCTIONS}
            for text in positives + negatives:
                documents.setdefault(text, len(documents))
                self.document_instructions.setdefault(text, instructions["passage_instruction"])
            self.queries.append(query)
            self.query_instructions.append(instructions["query_instruction"])
            self.positive_ids.append({documents[p] for p in positives})
            for positive in positives if expand_positives else positives[:1]:
                self.examples.append({"query": query, "positive": positive, "positives": positives,
                                      "negatives": negatives, **instructions})
        bad_rows.report()
        if not self.examples:
            raise AutomodelError(f"dataset.path: '{source}' has no usable rows")
        self.corpus: list[str] = list(documents)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.examples[index]


def instructed(texts: list[str], instructions: list[str]) -> list[str]:
    """Each text after its instruction and a space (upstream's join), or alone where the instruction is empty."""
    return [f"{i} {t}" if i else t for t, i in zip(texts, instructions, strict=True)]


# ---- collation ----------------------------------------------------------------------------------------------

def tokenize(tokenizer: Any, texts: list[str], max_length: int, pairs: list[str] | None = None,
             pad_to_multiple_of: int | None = None) -> dict:
    encoded = tokenizer(texts, pairs, padding=True, truncation=True if pairs is None else "longest_first",
                        max_length=max_length, pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt")
    return dict(encoded)


class BiEncoderCollator:
    """Tokenizes a batch's queries and documents: every positive first (query i's is document i), then every
    hard negative; ``document_owners`` [D] is the example each document came with. ``document_keys`` [D] and
    ``positive_keys`` [B, P] identify the documents by their text (see negatives.py), so that no copy of a query's
    positive counts as its negative. With ``use_instructions`` each
    query is put after its example's ``query_instruction`` and each document after its ``passage_instruction``
    (upstream's use_dataset_instruction)."""

    def __init__(self, tokenizer: Any, query_max_length: int = 64, document_max_length: int = 128,
                 query_prefix: str = "", document_prefix: str = "", pad_to_multiple_of: int | None = None,
                 use_instructions: bool = False):
        self.tokenizer = tokenizer
        self.query_max_length, self.document_max_length = query_max_length, document_max_length
        self.query_prefix, self.document_prefix = query_prefix, document_prefix
        self.pad_to_multiple_of = pad_to_multiple_of
        self.use_instructions = use_instructions

    def encode_queries(self, queries: list[str]) -> dict:
        return tokenize(self.tokenizer, [self.query_prefix + q for q in queries], self.query_max_length,
                        pad_to_multiple_of=self.pad_to_multiple_of)

    def encode_documents(self, documents: list[str]) -> dict:
        return tokenize(self.tokenizer, [self.document_prefix + d for d in documents], self.document_max_length,
                        pad_to_multiple_of=self.pad_to_multiple_of)

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        documents = [item["positive"] for item in items] + [n for item in items for n in item["negatives"]]
        queries = [item["query"] for item in items]
        owners = list(range(len(items))) + [i for i, item in enumerate(items) for _ in item["negatives"]]
        if self.use_instructions:
            queries = instructed(queries, [item.get("query_instruction", "") for item in items])
            texts = instructed(documents, [items[i].get("passage_instruction", "") for i in owners])
        else:
            texts = documents
        width = max(len(item["positives"]) for item in items)
        positive_keys = [[text_key(p) for p in item["positives"]] for item in items]
        positive_keys = [keys + [keys[0]] * (width - len(keys)) for keys in positive_keys]
        return {"query": self.encode_queries(queries), "document": self.encode_documents(texts),
                "labels": torch.arange(len(items)),
                "document_owners": torch.tensor(owners),
                "document_keys": torch.tensor([text_key(d) for d in documents], dtype=torch.long),
                "positive_keys": torch.tensor(positive_keys, dtype=torch.long)}


class CrossEncoderCollator:
    """Tokenizes each (query, document) pair jointly: per example its positive (column 0) and its negatives.

    ``valid`` [B, G] marks real pairs (examples with fewer negatives are padded); ``pairs`` holds the tokenized
    real pairs in row-major order of ``valid``.
    """

    def __init__(self, tokenizer: Any, max_length: int = 128, query_prefix: str = "", document_prefix: str = "",
                 prompt_template: str | None = None, pad_to_multiple_of: int | None = None):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.query_prefix, self.document_prefix = query_prefix, document_prefix
        self.prompt_template, self.pad_to_multiple_of = prompt_template, pad_to_multiple_of

    def encode(self, queries: list[str], documents: list[str]) -> dict:
        """Each pair as one sequence from ``prompt_template`` ({query}, {passage}), else as a tokenizer text pair."""
        if self.prompt_template is None:
            return tokenize(self.tokenizer, queries, self.max_length, documents, self.pad_to_multiple_of)
        texts = [self.prompt_template.format(query=q, passage=d) for q, d in zip(queries, documents, strict=True)]
        return tokenize(self.tokenizer, texts, self.max_length, pad_to_multiple_of=self.pad_to_multiple_of)

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        group = 1 + max(len(item["negatives"]) for item in items)
        valid = torch.zeros(len(items), group, dtype=torch.bool)
        queries, documents = [], []
        for i, item in enumerate(items):
            docs = [item["positive"], *item["negatives"]]
            valid[i, : len(docs)] = True
            queries += [self.query_prefix + item["query"]] * len(docs)
            documents += [self.document_prefix + d for d in docs]
        return {"pairs": self.encode(queries, documents), "valid": valid,
                "labels": torch.zeros(len(items), dtype=torch.long)}
