"""The step loss is the mean over all label tokens of the whole step (DESIGN §9), whatever the micro-batching.

Answers here range from 1 to 12 words, so micro-batches hold very different numbers of label tokens and are padded
differently: a mean of micro-batch means (or a per-micro-batch mean loss) gives different losses and gradients.
"""

from __future__ import annotations

import json

import pytest
from llm_testing import assert_states_equal, read_jsonl, train_inprocess

WORDS = "the green duck of Yara lives in Tolven near the old mill by the tower".split()


@pytest.fixture(scope="module")
def ragged_squad(tmp_path_factory):
    """16 QA rows; answer lengths 1, 12, 2, 11, ... so neighbouring samples differ a lot."""
    root = tmp_path_factory.mktemp("ragged_squad")
    lengths = [1, 12, 2, 11, 3, 10, 4, 9, 5, 8, 6, 7, 1, 12, 2, 11]
    with open(root / "train.jsonl", "w") as f:
        for i, n in enumerate(lengths):
            answer = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))
            context = f"Item {i}: {answer}. Tovi works at the bakery."
            f.write(json.dumps({"id": str(i), "context": context, "question": f"What is item {i}?",
                                "answers": {"text": [answer], "answer_start": [0]}}) + "\n")
    return root


def run(make_config, tmp_path, name, batch_size, accumulation, data):
    config = make_config(
        f"{name}.yaml",
        step_scheduler={"max_steps": 2, "grad_accumulation_steps": accumulation, "global_batch_size": 8},
        dataset={"dataset_name": str(data), "limit_dataset_samples": None, "max_seq_length": 128},
        dataloader={"batch_size": batch_size, "shuffle": False},
        checkpoint={"enabled": False, "checkpoint_dir": str(tmp_path / name)},
        optimizer={"lr": 1.0e-3},
    )
    recipe = train_inprocess(config)
    return recipe, read_jsonl(tmp_path / name / "training.jsonl")


def test_micro_batching_does_not_change_losses_or_weights(make_config, tmp_path, ragged_squad):
    small, small_rows = run(make_config, tmp_path, "accumulated", 2, 4, ragged_squad)
    big, big_rows = run(make_config, tmp_path, "single", 8, 1, ragged_squad)

    # The test only means something if the micro-batches carry different numbers of label tokens.
    counts = [small.count_label_tokens(b) for b in list(small.dataloader)[:4]]
    assert len(set(counts)) > 1, counts

    assert [r["step"] for r in small_rows] == [r["step"] for r in big_rows] == [1, 2]
    for a, b in zip(small_rows, big_rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-5)
    assert_states_equal(small.model.state_dict(), big.model.state_dict(), atol=1e-5)


def test_step_loss_is_token_weighted_not_mean_of_means(make_config, tmp_path, ragged_squad):
    """The logged step-1 loss equals (sum of token losses) / (label tokens) recomputed from the initial model."""
    import torch

    captured = {}

    def snapshot(recipe):
        # Sharpen the freshly initialised output layer so token losses differ (at a near-uniform init every
        # token costs ~log V and the two averages coincide).
        with torch.no_grad():
            recipe.model.get_output_embeddings().weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
        captured["state"] = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
        captured["batches"] = list(recipe.dataloader)[:4]

    config = make_config(step_scheduler={"max_steps": 1, "grad_accumulation_steps": 4},
                         dataset={"dataset_name": str(ragged_squad), "limit_dataset_samples": None,
                                  "max_seq_length": 128},
                         dataloader={"batch_size": 2, "shuffle": False}, checkpoint={"enabled": False})
    recipe = train_inprocess(config, before_run=snapshot)
    logged = read_jsonl(tmp_path / "ckpt" / "training.jsonl")[0]["loss"]

    model = recipe.model
    model.load_state_dict(captured["state"])
    sums, counts = [], []
    with torch.no_grad():
        for batch in captured["batches"]:
            sums.append(float(recipe.compute_loss(model, batch)))
            counts.append(recipe.count_label_tokens(batch))
    token_weighted = sum(sums) / sum(counts)
    mean_of_means = sum(s / c for s, c in zip(sums, counts, strict=True)) / len(sums)
    assert logged == pytest.approx(token_weighted, abs=1e-5)
    assert abs(token_weighted - mean_of_means) > 1e-4, "data not ragged enough to tell the two apart"
