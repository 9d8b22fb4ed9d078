"""Upstream's corpus-id retrieval data: documents by id in corpus folders, each described by its metadata.

A data file is JSON ``{"corpus": [{"path": folder}], "data": [{question_id, question, corpus_id, pos_doc: [{id}],
neg_doc: [{id}]}]}`` (a folder path relative to the file's directory). Each corpus folder holds
``merlin_metadata.json`` (``class``, ``corpus_id``, and optionally ``query_instruction`` / ``passage_instruction``)
and the documents: table files (parquet, JSON / JSONL or CSV) with ``id`` and ``text`` columns. Text corpora
(upstream's ``TextQADataset`` class) are read; image corpora are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError

METADATA = "merlin_metadata.json"
TEXT_CORPUS = "TextQADataset"
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
REQUIRED = ("question_id", "question", "corpus_id", "pos_doc", "neg_doc")


@dataclass
class Corpus:
    """One corpus folder: its documents by id and the instructions its metadata gives."""

    corpus_id: str
    path: Path
    documents: dict[str, str]
    query_instruction: str = ""
    passage_instruction: str = ""


def is_corpus_id_data(data: Any) -> bool:
    return isinstance(data, dict) and "corpus" in data and "data" in data


def read_corpus(path: Path) -> Corpus:
    """The corpus in folder ``path`` (its metadata and its documents)."""
    import datasets

    metadata_file = path / METADATA
    if not metadata_file.is_file():
        raise AutomodelError(f"dataset.data_dir_list: the corpus folder '{path}' has no {METADATA}")
    metadata = json.loads(metadata_file.read_text(encoding="utf-8"))
    if metadata.get("class") != TEXT_CORPUS:
        raise AutomodelError(f"dataset.data_dir_list: corpus '{path}' is of class {metadata.get('class')!r}; only "
                             f"text corpora ({TEXT_CORPUS}) are read here (image corpora are not implemented)")
    files = sorted(f for f in path.rglob("*") if f.suffix in _BUILDERS and f.name != METADATA)
    builders = {_BUILDERS[f.suffix] for f in files}
    if len(builders) != 1:
        raise AutomodelError(f"dataset.data_dir_list: corpus '{path}' needs its documents in table files of one "
                             f"kind ({', '.join(_BUILDERS)}), found {[f.name for f in files]}")
    rows = datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train")
    if not {"id", "text"} <= set(rows.column_names):
        raise AutomodelError(f"dataset.data_dir_list: corpus '{path}' needs 'id' and 'text' columns, found "
                             f"{rows.column_names}")
    return Corpus(str(metadata["corpus_id"]), path, {str(i): t for i, t in zip(rows["id"], rows["text"], strict=True)},
                  metadata.get("query_instruction") or "", metadata.get("passage_instruction") or "")


def _ids(docs: Any) -> list[str]:
    return [str(d["id"]) if isinstance(d, dict) else str(d) for d in docs]


def corpus_id_records(file: Path, data: dict[str, Any], corpora: dict[str, Corpus],
                      use_instructions: bool) -> list[dict[str, Any]]:
    """The rows of corpus-id data file ``file`` as inline records {question, pos_doc, neg_doc} (the documents'
    text), with their corpus's instructions when ``use_instructions`` (else empty, as upstream)."""
    entries = data["corpus"] if isinstance(data["corpus"], list) else [data["corpus"]]
    for entry in entries:
        folder = Path(entry["path"]) if Path(entry["path"]).is_absolute() else file.parent / entry["path"]
        corpus = read_corpus(folder)
        known = corpora.setdefault(corpus.corpus_id, corpus)
        if known.path.resolve() != folder.resolve():
            raise AutomodelError(f"dataset.data_dir_list: corpus id '{corpus.corpus_id}' names two folders: "
                                 f"'{known.path}' and '{folder}'")
    records = []
    for index, item in enumerate(data["data"]):
        missing = [name for name in REQUIRED if name not in item]
        if missing:
            raise AutomodelError(f"dataset.data_dir_list: '{file}' row {index + 1} misses {', '.join(missing)}")
        corpus = corpora.get(str(item["corpus_id"]))
        if corpus is None:
            raise AutomodelError(f"dataset.data_dir_list: '{file}' row {index + 1} names corpus "
                                 f"'{item['corpus_id']}', which its corpus folders do not hold")
        unknown = [i for i in _ids(item["pos_doc"]) + _ids(item["neg_doc"]) if i not in corpus.documents]
        if unknown:
            raise AutomodelError(f"dataset.data_dir_list: '{file}' row {index + 1} names documents {unknown} that "
                                 f"corpus '{corpus.corpus_id}' does not hold")
        records.append({"question": item["question"],
                        "pos_doc": [corpus.documents[i] for i in _ids(item["pos_doc"])],
                        "neg_doc": [corpus.documents[i] for i in _ids(item["neg_doc"])],
                        "query_instruction": corpus.query_instruction if use_instructions else "",
                        "passage_instruction": corpus.passage_instruction if use_instructions else ""})
    return records
