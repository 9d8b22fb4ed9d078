"""The shipped example assets are what the scripts in automodel-retrieval/scripts/ produce, and fit together."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys

from retrieval_testing import ASSETS, BERT_CONFIG, DIST_DIR, TOKENIZER_DIR

from automodel.testing import read_jsonl


def _run_script(name: str, *args: str, monkeypatch) -> None:
    """Run scripts/<name>.py's main() in this process (its imports are already loaded here)."""
    path = DIST_DIR / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    module.main()


def test_generated_data_is_reproducible_and_held_out(tmp_path, monkeypatch):
    _run_script("make_tiny_retrieval", "--out", str(tmp_path), monkeypatch=monkeypatch)
    for name in ("train.jsonl", "validation.jsonl", "corpus.jsonl"):
        assert (tmp_path / name).read_bytes() == (ASSETS / "tiny_retrieval" / name).read_bytes(), name
    train, validation = read_jsonl(tmp_path / "train.jsonl"), read_jsonl(tmp_path / "validation.jsonl")
    corpus = {r["text"] for r in read_jsonl(tmp_path / "corpus.jsonl")}
    seen = {r["positive"] for r in train} | {n for r in train for n in r["negatives"]}
    held_out = {r["positive"] for r in validation}
    assert not held_out & seen, "a validation positive appears in the training rows"
    assert {r["positive"] for r in train} | held_out <= corpus
    assert all(len(r["negatives"]) == 3 and r["positive"] not in r["negatives"] for r in train + validation)


def _data_words() -> set[str]:
    words = set()
    for name in ("train.jsonl", "validation.jsonl"):
        for row in read_jsonl(ASSETS / "tiny_retrieval" / name):
            for text in [row["query"], row["positive"], *row["negatives"]]:
                words.update(re.findall(r"\w+|[^\w\s]", text.lower()))
    return words


def test_tokenizer_is_reproducible_and_fits_the_model(tmp_path, monkeypatch):
    """The script retrains a tokenizer that encodes the data like the shipped one: every word is one token (the
    WordPiece trainer breaks frequency ties in hash order, so vocabularies and ids vary between runs)."""
    from transformers import AutoTokenizer

    shutil.copy(BERT_CONFIG, tmp_path / "config.json")
    _run_script("train_tiny_tokenizer", "--out", str(tmp_path / "tok"), "--model-config",
                str(tmp_path / "config.json"), monkeypatch=monkeypatch)
    words = sorted(_data_words())
    assert len(words) > 300
    for directory in (TOKENIZER_DIR, tmp_path / "tok"):
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        split = [w for w in words if len(tokenizer.tokenize(w)) != 1]
        assert not split, f"{directory}: words split into pieces: {split[:10]}"
    retrained = json.loads((tmp_path / "config.json").read_text())
    assert retrained["vocab_size"] == len(AutoTokenizer.from_pretrained(str(tmp_path / "tok")))
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    config = json.loads(BERT_CONFIG.read_text())
    assert len(tokenizer) == config["vocab_size"] and config["hidden_size"] == 64
    assert config["num_hidden_layers"] == 2 and config["pad_token_id"] == tokenizer.pad_token_id
    pair = tokenizer("capital of Sikia", "Sikia's capital city is Zoranton.")
    assert pair["input_ids"][0] == tokenizer.cls_token_id and set(pair["token_type_ids"]) == {0, 1}
