"""Upstream's use_dataset_instruction: a corpus-id data set gives each example its corpus's query and passage
instructions (merlin_metadata.json), and a collator with use_dataset_instruction puts each text after its
instruction (instead of a prefix), in training and in validation's ranking, as upstream does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from retrieval_testing import BERT_CONFIG, DATA, TOKENIZER_DIR

from automodel import testing
from automodel.errors import AutomodelError, ConfigError

BI = Path(__file__).parent / "upstream_forms" / "bi_encoder_upstream.yaml"
BI_ROUTE = ("finetune", "retrieval")

QUERY_INSTRUCTION, PASSAGE_INSTRUCTION = "capital", "city"  # words of the tiny vocabulary


def _corpus(root, corpus_id, instructions, rows):
    """A corpus folder (its metadata and documents) and a data file naming its documents by id."""
    folder = root / corpus_id
    folder.mkdir(parents=True)
    (folder / "merlin_metadata.json").write_text(json.dumps({"class": "TextQADataset", "corpus_id": corpus_id,
                                                             **instructions}))
    texts = list(dict.fromkeys(t for r in rows for t in [r["positive"], *r["negatives"]]))
    (folder / "documents.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                                                    for i, t in enumerate(texts)))
    ids = {t: f"d{i}" for i, t in enumerate(texts)}
    data = {"corpus": [{"path": corpus_id}],
            "data": [{"question_id": f"q{n}", "question": r["query"], "corpus_id": corpus_id,
                      "pos_doc": [{"id": ids[r["positive"]]}], "neg_doc": [{"id": ids[t]} for t in r["negatives"]]}
                     for n, r in enumerate(rows)]}
    (root / f"{corpus_id}.json").write_text(json.dumps(data))
    return root / f"{corpus_id}.json"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus_id")
    rows = testing.read_jsonl(DATA / "train.jsonl")[:48]
    facts = _corpus(root, "facts", {"query_instruction": QUERY_INSTRUCTION,
                                    "passage_instruction": PASSAGE_INSTRUCTION}, rows[:32])
    plain = _corpus(root, "plain", {}, rows[32:])
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    AutoModel.from_config(AutoConfig.from_pretrained(str(BERT_CONFIG))).save_pretrained(str(root / "encoder"))
    return {"facts": facts, "plain": plain, "rows": rows, "encoder": root / "encoder"}


def test_the_data_set_reads_documents_by_id_and_its_corpus_instructions(corpora):
    from automodel_retrieval.upstream import retrieval_dataset

    rows = corpora["rows"]
    dataset = retrieval_dataset([str(corpora["facts"]), str(corpora["plain"])], n_passages=3,
                                use_dataset_instruction=True)
    first, last = dataset[0], dataset[len(dataset) - 1]
    assert (first["query"], first["positive"], first["negatives"]) == (rows[0]["query"], rows[0]["positive"],
                                                                      rows[0]["negatives"][:2])
    assert (first["query_instruction"], first["passage_instruction"]) == (QUERY_INSTRUCTION, PASSAGE_INSTRUCTION)
    assert (last["query_instruction"], last["passage_instruction"]) == ("", ""), "no instruction in its metadata"
    assert dataset.query_instructions[:1] == [QUERY_INSTRUCTION]
    assert dataset.document_instructions[rows[0]["positive"]] == PASSAGE_INSTRUCTION
    without = retrieval_dataset([str(corpora["facts"])], n_passages=3)
    assert without[0]["query_instruction"] == "" and without[0]["positive"] == rows[0]["positive"]


def test_the_collator_puts_each_text_after_its_instruction(corpora):
    from transformers import AutoTokenizer

    from automodel_retrieval.upstream import UpstreamBiEncoderCollator, retrieval_dataset

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    dataset = retrieval_dataset([str(corpora["facts"]), str(corpora["plain"])], n_passages=2,
                                use_dataset_instruction=True)
    items = [dataset[0], dataset[len(dataset) - 1]]
    batch = UpstreamBiEncoderCollator(tokenizer, 32, 48, use_dataset_instruction=True)(items)
    queries = [f"{QUERY_INSTRUCTION} {items[0]['query']}", items[1]["query"]]
    documents = [f"{PASSAGE_INSTRUCTION} {items[0]['positive']}", items[1]["positive"],
                 f"{PASSAGE_INSTRUCTION} {items[0]['negatives'][0]}", items[1]["negatives"][0]]
    expected = tokenizer(queries, padding=True, truncation=True, max_length=32, return_tensors="pt")
    assert batch["query"]["input_ids"].tolist() == expected["input_ids"].tolist()
    expected = tokenizer(documents, padding=True, truncation=True, max_length=48, return_tensors="pt")
    assert batch["document"]["input_ids"].tolist() == expected["input_ids"].tolist()
    plain = UpstreamBiEncoderCollator(tokenizer, 32, 48)(items)
    assert plain["query"]["input_ids"].tolist() != batch["query"]["input_ids"].tolist(), "the flag acts"


def test_training_and_validation_use_the_instructions(corpora, tmp_path):
    recipe = testing.train_inprocess(
        BI, "--model.pretrained_model_name_or_path", corpora["encoder"],
        "--dataset.data_dir_list", f"[{corpora['facts']}]", "--dataset.use_dataset_instruction", "true",
        "--validation_dataset.data_dir_list", f"[{corpora['plain']}, {corpora['facts']}]",
        "--validation_dataset.use_dataset_instruction", "true", "--dataloader.collate_fn.use_dataset_instruction",
        "true", "--dataloader.collate_fn.query_prefix", "", "--dataloader.collate_fn.passage_prefix", "",
        "--checkpoint.checkpoint_dir", tmp_path, route=BI_ROUTE)
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "training.jsonl")] == [3]
    collator = recipe.default_collate_fn(False)
    assert collator.use_instructions
    seen = []
    recipe._embed = lambda model, side, texts, collator: seen.append((side, texts)) or torch.eye(len(texts), 4)
    recipe.extra_validation_metrics("validation", recipe.val_dataloaders["validation"])
    rows = corpora["rows"]
    assert dict(seen)["query"] == [r["query"] for r in rows[32:]] + [f"{QUERY_INSTRUCTION} {r['query']}"
                                                                     for r in rows[:32]], "the facts corpus's only"
    documents = dict(seen)["document"]
    assert any(d.startswith(f"{PASSAGE_INSTRUCTION} ") for d in documents)


def test_instructions_need_corpus_metadata_and_replace_the_prefixes(tmp_path):
    from automodel_retrieval.upstream import retrieval_dataset

    inline = tmp_path / "inline.jsonl"
    inline.write_text(json.dumps({"query": "q", "pos_doc": "p", "neg_doc": ["n"]}) + "\n")
    with pytest.raises(AutomodelError, match="inline records, which have none"):
        retrieval_dataset([str(inline)], use_dataset_instruction=True)
    with pytest.raises(ConfigError) as info:
        testing.load_config(BI, "--model.pretrained_model_name_or_path", TOKENIZER_DIR,
                            "--dataloader.collate_fn.use_dataset_instruction", "true", route=BI_ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert "instead of a prefix" in found["dataloader.collate_fn.query_prefix"], found
