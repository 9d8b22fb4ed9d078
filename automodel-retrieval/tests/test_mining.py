"""Hard-negative mining: never a positive, the margin holds, the chunk size changes nothing, the output trains."""

from __future__ import annotations

import json

import pytest
from retrieval_testing import BI_ENCODER, DATA, encode_with_transformers, latest, run_inprocess, write_config

from automodel.testing import read_jsonl

NUM_NEGATIVES = 4


def _mining_config(path, model, output, **mining):
    import yaml

    section = {"model": str(model), "data": str(DATA / "train.jsonl"), "corpus": str(DATA / "corpus.jsonl"),
               "output": str(output), "num_negatives": NUM_NEGATIVES, "margin_type": "perc", "margin": 0.95,
               "limit": 96, **mining}
    path.write_text(yaml.safe_dump({"mining": section}))
    return path


def _mine(tmp_path, model, name, **mining):
    from automodel.cli.main import main

    output = tmp_path / f"{name}.jsonl"
    config = _mining_config(tmp_path / f"{name}.yaml", model, output, **mining)
    assert main(["mine", "retrieval", "-c", str(config)]) == 0
    return read_jsonl(output)


@pytest.fixture(scope="module")
def independent_scores(bi_encoder_run):
    """Every (query, document) score of the first 96 training queries, computed with transformers alone."""
    model_dir = latest(bi_encoder_run["ckpt"]) / "model"
    rows = read_jsonl(DATA / "train.jsonl")[:96]
    corpus = [r["text"] for r in read_jsonl(DATA / "corpus.jsonl")]
    queries = encode_with_transformers(model_dir / "query_encoder", [r["query"] for r in rows], max_length=32)
    documents = encode_with_transformers(model_dir / "document_encoder", corpus, max_length=48)
    return rows, corpus, (queries.double() @ documents.double().T)


@pytest.fixture(scope="module")
def mined(bi_encoder_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("mined")
    one_chunk = _mine(root, bi_encoder_run["ckpt"], "one_chunk", chunk_size=100_000)
    chunked = _mine(root, bi_encoder_run["ckpt"], "chunked", chunk_size=7, query_batch_size=5)
    return {"root": root, "one_chunk": one_chunk, "chunked": chunked}


def test_mining_a_corpus_in_chunks_gives_the_one_chunk_result(mined):
    assert len(mined["one_chunk"]) == 96
    assert mined["chunked"] == mined["one_chunk"]


def test_mined_negatives_are_never_positives_and_respect_the_margin(mined, independent_scores):
    rows, corpus, scores = independent_scores
    index = {text: i for i, text in enumerate(corpus)}
    filtered = 0
    for q, (row, out) in enumerate(zip(rows, mined["one_chunk"], strict=True)):
        assert out["query"] == row["query"] and out["positives"] == [row["positive"]]
        assert row["positive"] not in out["negatives"]
        positive = float(scores[q, index[row["positive"]]])
        assert out["positive_scores"] == pytest.approx([positive], abs=1e-5)
        threshold = 0.95 * positive
        assert len(out["negatives"]) == len(out["negative_scores"]) <= NUM_NEGATIVES
        for text, score in zip(out["negatives"], out["negative_scores"], strict=True):
            assert score == pytest.approx(float(scores[q, index[text]]), abs=1e-5)
            assert score <= threshold + 1e-6
        # exactly the best eligible documents, in order
        eligible = sorted(((float(s), i) for i, s in enumerate(scores[q].tolist())
                           if i != index[row["positive"]] and s <= threshold), key=lambda t: (-t[0], t[1]))
        assert out["negative_scores"] == pytest.approx([s for s, _ in eligible[:NUM_NEGATIVES]], abs=1e-5)
        filtered += sum(1 for i, s in enumerate(scores[q].tolist())
                        if i != index[row["positive"]] and s > threshold + 1e-4)
    assert filtered > 0, "the margin filter never acted: the test would not notice it missing"


def test_abs_margin(bi_encoder_run, tmp_path, independent_scores, capsys):
    rows, corpus, scores = independent_scores
    index = {text: i for i, text in enumerate(corpus)}
    out = _mine(tmp_path, latest(bi_encoder_run["ckpt"]), "abs", margin_type="abs", margin=0.2, limit=24)
    assert len(out) == 24
    progress = capsys.readouterr().err
    assert "embed corpus: " in progress and "search: " in progress  # one line per task: stderr is no terminal
    assert "\r" not in progress
    for q, record in enumerate(out):
        positive = float(scores[q, index[rows[q]["positive"]]])
        assert all(s <= positive - 0.2 + 1e-6 for s in record["negative_scores"])
        assert rows[q]["positive"] not in record["negatives"]


def test_mined_file_is_bi_encoder_training_data(mined, tmp_path):
    path = mined["root"] / "one_chunk.jsonl"
    config = write_config(tmp_path / "cfg.yaml", BI_ENCODER, tmp_path / "ckpt", validation_dataset=None,
                          step_scheduler={"max_steps": 2},
                          dataset={"path": str(path), "num_negatives": NUM_NEGATIVES})
    recipe = run_inprocess("bi", config)
    assert recipe.step_scheduler.step == 2
    first = recipe.train_dataset[0]
    assert first["negatives"] == mined["one_chunk"][0]["negatives"]


def test_mining_config_is_validated(tmp_path):
    from automodel.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"mining": {"data": "x.jsonl", "output": "o.jsonl", "margin": 2.0,
                                          "chunk_size": 0}}))
    assert main(["validate", "mine", "retrieval", "-c", str(bad)]) == 2


def test_mining_recipe_is_not_a_training_loop():
    from automodel.recipe import BaseRecipe
    from automodel.training.recipe import TrainRecipe
    from automodel_retrieval.mining import MineHardNegativesRecipe

    assert issubclass(MineHardNegativesRecipe, BaseRecipe)
    assert not issubclass(MineHardNegativesRecipe, TrainRecipe)


def test_a_missing_required_key_names_its_other_spellings(tmp_path):
    from automodel.config import ConfigError
    from automodel.testing import load_config, write_yaml

    config = write_yaml(tmp_path / "mine.yaml", {"mining": {"data": "rows.jsonl", "output": "out.jsonl"}})
    with pytest.raises(ConfigError) as refused:
        load_config(config, route=("mine", "retrieval"))
    assert ("mining.model: required key is missing (also written model_name_or_path): give it here or as "
            "--mining.model") in str(refused.value)
