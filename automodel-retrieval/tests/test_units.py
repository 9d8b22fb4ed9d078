"""Unit tests of the pieces: pooling, losses, collation, the data set, metrics and the chunked top-k search."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from retrieval_testing import TOKENIZER_DIR

from automodel_retrieval.data import BiEncoderCollator, CrossEncoderCollator, RetrievalDataset
from automodel_retrieval.losses import InfoNCELoss, ListwiseCrossEntropy
from automodel_retrieval.metrics import group_metrics, ranking_metrics
from automodel_retrieval.mining import margin_thresholds, top_k_negatives
from automodel_retrieval.models import pool
from automodel_retrieval.negatives import exclusions

# ---- pooling ------------------------------------------------------------------------------------------------

def test_pooling_mean_cls_last_with_right_and_left_padding():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(pool(hidden, right, "mean")[0], hidden[0, :2].mean(0))
    assert torch.equal(pool(hidden, right, "mean")[1], hidden[1].mean(0))
    assert torch.equal(pool(hidden, right, "cls"), hidden[:, 0])
    assert torch.equal(pool(hidden, right, "last")[0], hidden[0, 1])
    assert torch.equal(pool(hidden, left, "last")[0], hidden[0, 3])
    assert torch.equal(pool(hidden, left, "last")[1], hidden[1, 3])
    with pytest.raises(Exception, match="pooling"):
        pool(hidden, right, "max")


# ---- losses -------------------------------------------------------------------------------------------------

def test_infonce_matches_the_formula_and_exclusion_removes_a_document():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(3, 8), dim=-1), F.normalize(torch.randn(7, 8), dim=-1)
    labels = torch.tensor([0, 1, 2])
    loss = InfoNCELoss(temperature=0.1)(q, d, labels)
    logits = q @ d.T / 0.1
    expected = -(logits.log_softmax(-1)[torch.arange(3), labels]).sum()
    assert torch.allclose(loss, expected, atol=1e-5)
    exclude = torch.zeros(3, 7, dtype=torch.bool)
    exclude[0, 5] = True
    excluded = InfoNCELoss(temperature=0.1)(q, d, labels, exclude)
    keep = [0, 1, 2, 3, 4, 6]
    first = -(logits[0, keep].log_softmax(-1)[0])
    rest = -(logits[1:].log_softmax(-1)[torch.arange(2), labels[1:]]).sum()
    assert torch.allclose(excluded, first + rest, atol=1e-5)
    with pytest.raises(ValueError):
        InfoNCELoss(temperature=0.0)


def test_listwise_cross_entropy_ignores_padded_candidates():
    scores = torch.tensor([[2.0, 1.0, 0.5], [0.1, 3.0, -5.0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    loss = ListwiseCrossEntropy()(scores, valid)
    expected = -(scores[0].log_softmax(-1)[0] + scores[1, :2].log_softmax(-1)[0])
    assert torch.allclose(loss, expected)


# ---- data ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dataset_reads_positive_or_positives_and_builds_the_corpus(tmp_path):
    rows = [{"query": "q1", "positives": ["a", "b"], "negatives": ["c", "a", "d", "e"]},
            {"query": "q2", "positive": {"title": "T", "text": "f"}, "negatives": ["a"]},
            {"query": "q3", "positive": "c"}]
    corpus = _write(tmp_path / "corpus.jsonl", [{"text": "z"}, {"text": "a"}])
    dataset = RetrievalDataset(str(_write(tmp_path / "d.jsonl", rows)), corpus=str(corpus), num_negatives=2)
    assert len(dataset) == 4  # one example per (query, positive)
    assert [e["positive"] for e in dataset] == ["a", "b", "T f", "c"]
    assert dataset[0]["negatives"] == ["c", "d"]  # a positive listed as a negative is dropped, then 2 kept
    assert dataset[3]["negatives"] == []
    assert dataset.corpus == ["z", "a", "b", "c", "d", "T f"]
    assert dataset.queries == ["q1", "q2", "q3"]
    assert dataset.positive_ids == [{1, 2}, {5}, {3}]
    only_first = RetrievalDataset(str(tmp_path / "d.jsonl"), expand_positives=False)
    assert len(only_first) == 3


def test_dataset_errors_name_the_problem(tmp_path):
    with pytest.raises(Exception, match="no 'positive'"):
        RetrievalDataset(str(_write(tmp_path / "bad.jsonl", [{"query": "q", "negatives": ["x"]}])))
    with pytest.raises(Exception, match="does not exist"):
        RetrievalDataset(str(tmp_path / "missing.jsonl"))


def test_bi_encoder_collator_puts_positives_first_and_excludes_duplicate_positives(tokenizer):
    items = [{"query": "capital of x", "positive": "p1", "positives": ["p1", "p2"], "negatives": ["n1", "p2"]},
             {"query": "ruler of y", "positive": "p2", "positives": ["p1", "p2"], "negatives": []},
             {"query": "currency of z", "positive": "p3", "positives": ["p3"], "negatives": ["n2"]}]
    batch = BiEncoderCollator(tokenizer, 8, 8)(items)
    assert batch["labels"].tolist() == [0, 1, 2]
    assert batch["query"]["input_ids"].shape[0] == 3 and batch["document"]["input_ids"].shape[0] == 6
    # documents: p1 p2 p3 n1 p2 n2 -> query 0 must not be pushed away from p2 (columns 1 and 4), nor query 1 from p1
    exclude = exclusions(batch["document_keys"], batch["positive_keys"], batch["labels"])
    assert exclude.nonzero().tolist() == [[0, 1], [0, 4], [1, 0], [1, 4]]
    # keys of the texts, not of their position: the same on another rank (gathered documents come in any order)
    shuffled = torch.tensor([5, 4, 3, 2, 1, 0])
    assert torch.equal(exclusions(batch["document_keys"][shuffled], batch["positive_keys"], torch.tensor([5, 4, 3])),
                       exclude[:, shuffled])


def test_cross_encoder_collator_groups_pairs_with_padding(tokenizer):
    items = [{"query": "q", "positive": "p", "positives": ["p"], "negatives": ["a", "b"]},
             {"query": "r", "positive": "s", "positives": ["s"], "negatives": []}]
    batch = CrossEncoderCollator(tokenizer, 16)(items)
    assert batch["valid"].tolist() == [[True, True, True], [True, False, False]]
    assert batch["pairs"]["input_ids"].shape[0] == 4
    assert batch["pairs"]["token_type_ids"][0].max() == 1  # query and document encoded as one pair
    assert batch["labels"].tolist() == [0, 0]


# ---- metrics ------------------------------------------------------------------------------------------------

def test_ranking_metrics_and_ties_count_against_the_positive():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.2, 0.8, 0.9, 0.1], [0.5, 0.5, 0.5, 0.5]])
    metrics = ranking_metrics(scores, [{0}, {1, 3}, {0}], ks=(1, 2))
    # q0: rank 1; q1: positives rank 2 and 4; q2: all tied -> rank 4
    assert metrics["recall@1"] == pytest.approx(1 / 3)
    assert metrics["recall@2"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert metrics["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 4) / 3)
    correct, reciprocal, chance = group_metrics(torch.tensor([[3.0, 1.0, 2.0], [1.0, 1.0, 9.0]]),
                                                torch.tensor([[True, True, True], [True, True, False]]),
                                                torch.tensor([0, 0]))
    assert (correct, reciprocal, chance) == (1.0, 1.5, pytest.approx(1 / 3 + 1 / 2))


# ---- the chunked search -------------------------------------------------------------------------------------

def _brute_force(queries, corpus, excluded, thresholds, k):
    scores = (queries.double() @ corpus.double().T).tolist()
    out = []
    for q, row in enumerate(scores):
        eligible = [(s, i) for i, s in enumerate(row) if i not in excluded[q] and s <= float(thresholds[q])]
        eligible.sort(key=lambda t: (-t[0], t[1]))
        out.append([i for _, i in eligible[:k]])
    return out


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
def test_top_k_is_independent_of_the_chunk_size_and_honours_exclusions(chunk_size):
    torch.manual_seed(0)
    base = F.normalize(torch.randn(9, 6), dim=-1)
    corpus = torch.cat([base, base[:4]])  # exact duplicates: ties must break towards the earlier document
    queries = F.normalize(torch.randn(5, 6), dim=-1)
    excluded = [{0}, {1, 9}, set(), {12}, {2, 3}]
    positive = torch.tensor([0.9, 0.5, 0.3, 0.7, 0.2], dtype=torch.float64)
    thresholds = margin_thresholds(positive, "perc", 0.9)
    ids, scores = top_k_negatives(queries, corpus, excluded, thresholds, 4, chunk_size, query_batch_size=2)
    assert ids == _brute_force(queries, corpus, excluded, thresholds, 4)
    for q in range(5):
        assert not set(ids[q]) & excluded[q]
        assert all(s <= float(thresholds[q]) for s in scores[q])
        assert scores[q] == sorted(scores[q], reverse=True)


def test_margin_thresholds():
    positive = torch.tensor([0.8, 0.5], dtype=torch.float64)
    assert margin_thresholds(positive, "perc", 0.5).tolist() == [0.4, 0.25]
    assert margin_thresholds(positive, "abs", 0.1).tolist() == pytest.approx([0.7, 0.4])
    assert margin_thresholds(positive, "none", 0.1).tolist() == [float("inf")] * 2


def test_every_trainable_bi_encoder_parameter_gets_a_gradient(tokenizer):
    """DDP (no find_unused_parameters) needs every trainable parameter in the loss's graph: BERT's own pooler,
    which the bi-encoder's pooling does not use, is frozen."""
    from retrieval_testing import BERT_CONFIG

    from automodel_retrieval import BiEncoder

    model = BiEncoder.from_config(str(BERT_CONFIG), seed=0)
    assert not any(p.requires_grad for p in model.query_encoder.pooler.parameters())
    items = [{"query": "capital of x", "positive": "x's capital", "positives": ["x's capital"], "negatives": ["y"]},
             {"query": "ruler of z", "positive": "z is ruled", "positives": ["z is ruled"], "negatives": []}]
    batch = BiEncoderCollator(tokenizer, 8, 8)(items)
    q, d = model(query=batch["query"], document=batch["document"])
    InfoNCELoss()(q, d, batch["labels"], exclusions(batch["document_keys"], batch["positive_keys"],
                                                    batch["labels"])).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    # the document encoder starts as a copy of the query encoder, then trains on its own
    assert model.document_encoder is not model.query_encoder
    for a, b in zip(model.query_encoder.parameters(), model.document_encoder.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form", ["file", "mapping", "directory"])
def test_from_config_refuses_a_key_the_config_lacks_and_takes_the_others(form):
    """A bi-encoder or cross-encoder built from a config (a config.json file, a mapping or a directory): a key the
    config class lacks was kept as an attribute nothing read (a checkpoint's path among them); it is refused, naming
    it, and a key of the config acts."""
    from retrieval_testing import BERT_CONFIG

    from automodel.errors import AutomodelError
    from automodel_retrieval import BiEncoder, CrossEncoder

    config = {"file": str(BERT_CONFIG), "mapping": json.loads(BERT_CONFIG.read_text()),
              "directory": str(BERT_CONFIG.parent)}[form]
    for build in (BiEncoder.from_config, CrossEncoder.from_config):
        with pytest.raises(AutomodelError, match=r"^model\.bogus: neither an argument of from_config"):
            build(config, bogus=1)
        with pytest.raises(AutomodelError, match=r"^model\.pretrained_model_name_or_path: .* end model\._target_ "
                                                 r"with from_pretrained"):
            build(config, pretrained_model_name_or_path="org/checkpoint")
    assert BiEncoder.from_config(config, hidden_dropout_prob=0.25).query_encoder.config.hidden_dropout_prob == 0.25
