"""Upstream's ``build_unpacked_dataset`` (``nemo_automodel.components.datasets.llm.mock``): random sentences of
varying length, token ids already (a tokenizer the run has is not used on them), trained as the CLI does."""

from __future__ import annotations

import pytest

from automodel.errors import AutomodelError
from automodel.testing import read_jsonl, train_inprocess
from automodel_llm.datasets import MockSentencesDataset

UPSTREAM = "nemo_automodel.components.datasets.llm.mock.build_unpacked_dataset"


def test_sentences_vary_around_the_mean_end_with_the_end_id_and_repeat_with_the_seed():
    data = MockSentencesDataset(num_sentences=200, mean_len=12, std_len=4, vocab_size=50, max_sentence_len=16, seed=3)
    lengths = [len(item["input_ids"]) - 1 for item in data]
    assert len(data) == 200 and min(lengths) >= 1 and max(lengths) == 16 and len(set(lengths)) > 5
    assert 10 < sum(lengths) / len(lengths) < 13  # the mean, pulled down by the cap at 16
    for item in data:
        assert item["input_ids"][-1] == 1 and all(2 <= token < 50 for token in item["input_ids"][:-1])
        assert item["labels"] == item["input_ids"]
    again = MockSentencesDataset(num_sentences=200, mean_len=12, std_len=4, vocab_size=50, max_sentence_len=16,
                                 seed=3)
    assert [a["input_ids"] for a in again] == [a["input_ids"] for a in data]
    other = MockSentencesDataset(num_sentences=200, mean_len=12, std_len=4, vocab_size=50, max_sentence_len=16)
    assert [a["input_ids"] for a in other] != [a["input_ids"] for a in data]
    fixed = MockSentencesDataset(num_sentences=5, mean_len=7, std_len=0)
    assert {len(item["input_ids"]) for item in fixed} == {8}


@pytest.mark.parametrize("arguments, key", [({"num_sentences": 0}, "num_sentences"), ({"vocab_size": 2}, "vocab_size"),
                                            ({"std_len": -1}, "std_len")])
def test_bad_arguments_name_the_key(arguments, key):
    with pytest.raises(AutomodelError, match=f"dataset.{key}"):
        MockSentencesDataset(**arguments)


def test_upstreams_form_trains(tmp_path, make_config):
    config = make_config(recipe="TrainFinetuneRecipeForNextTokenPrediction",
                         dataset={"_target_": UPSTREAM, "mean_len": 12, "std_len": 0, "vocab_size": 100,
                                  "max_sentence_len": 12, "seed": 0, "num_sentences": 16,
                                  "dataset_name": None, "split": None, "max_seq_length": None,
                                  "limit_dataset_samples": None},
                         step_scheduler={"max_steps": 3})
    train_inprocess(config)
    records = read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 < r["loss"] < 10 for r in records), records
