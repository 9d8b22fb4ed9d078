"""Context parallelism where this machine can test it: the refusal on CPU (and that torch's ring attention indeed
does not run here), how a batch is split over two cp ranks (tokens, positions and next-token targets stay
together, the label tokens add up), FSDP's mesh over dp x cp; expert parallelism refused."""

from __future__ import annotations

import pytest
import torch
from model_parallel_workers import lm_batch

from automodel.training.loss import IGNORE_INDEX
from automodel.training.parallel.context_parallel import ContextParallelBatch, cp_issues, next_token_targets


@pytest.fixture(scope="module")
def ranks(model_parallel_ranks):
    return [rank["cp"] for rank in model_parallel_ranks["two"]]


def test_cp_is_refused_on_cpu_saying_what_would_run_it():
    (issue,) = cp_issues("cpu", 2)
    assert issue.key == "distributed.cp_size"
    assert "flash or memory-efficient attention kernels on CUDA GPUs; this run is on cpu" in issue.message
    assert "set cp_size: 1" in issue.message
    assert cp_issues("cpu", 1) == []


def test_torch_ring_attention_does_not_run_on_cpu(ranks):
    """What the refusal says: torch's CP SDPA has no strategy for the CPU attention kernel."""
    for rank in ranks:
        assert "_scaled_dot_product_flash_attention_for_cpu" in rank["forward"]
        assert rank["hooked"] == 1  # the one layer's attention runs causal without the model's mask


def test_each_cp_rank_holds_tokens_positions_and_their_targets_together(ranks):
    ids, labels = lm_batch(0)
    targets = next_token_targets(labels)
    seen = []
    for rank in ranks:
        positions = torch.tensor(rank["positions"])
        assert torch.equal(torch.tensor(rank["ids"]), ids.gather(1, positions))
        assert torch.equal(torch.tensor(rank["targets"]), targets.gather(1, positions))
        seen += positions[0].tolist()
    assert sorted(seen) == list(range(ids.shape[1]))  # every position once over the two ranks
    assert ranks[0]["positions"][0] == [0, 1, 2, 3, 12, 13, 14, 15]  # load-balanced: chunks 0 and 3 of 4
    assert ranks[0]["tokens"] + ranks[1]["tokens"] == ranks[0]["global_tokens"]
    assert ranks[0]["fsdp_mesh"] == ["dp_shard_cp"]


def test_targets_are_the_next_tokens_labels():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 8]])
    assert next_token_targets(labels).tolist() == [[6, IGNORE_INDEX, 8, IGNORE_INDEX]]
    batch = ContextParallelBatch.from_labels(torch.tensor([[1, 2, 3, 4]]), labels)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3]]
    assert batch.label_tokens() == int((labels[:, 1:] != IGNORE_INDEX).sum()) == 2  # the engine's count

