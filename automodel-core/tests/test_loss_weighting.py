"""The step loss is the mean over all label tokens of the whole step (DESIGN §9), whatever the micro-batching.

The toy data's samples carry 1 to 4 targets each, so micro-batches hold different numbers of label tokens: a mean
of micro-batch means (or a per-micro-batch mean loss) gives different losses and gradients.
"""

from __future__ import annotations

import pytest
import torch

from automodel.testing import ToyRecipe, assert_states_equal, read_jsonl, toy_config, train_inprocess, write_yaml


def run(tmp_path, name, batch_size, accumulation):
    config = write_yaml(tmp_path / f"{name}.yaml", toy_config(
        tmp_path / name,
        step_scheduler={"max_steps": 2, "grad_accumulation_steps": accumulation, "global_batch_size": 8},
        dataloader={"batch_size": batch_size, "shuffle": False},
        checkpoint={"enabled": False},
        optimizer={"lr": 1.0e-3},
    ))
    recipe = train_inprocess(config, recipe=ToyRecipe)
    return recipe, read_jsonl(tmp_path / name / "training.jsonl")


def test_micro_batching_does_not_change_losses_or_weights(tmp_path):
    small, small_rows = run(tmp_path, "accumulated", 2, 4)
    big, big_rows = run(tmp_path, "single", 8, 1)

    # The test only means something if the micro-batches carry different numbers of label tokens.
    counts = [small.count_label_tokens(b) for b in list(small.dataloader)[:4]]
    assert len(set(counts)) > 1, counts

    assert [r["step"] for r in small_rows] == [r["step"] for r in big_rows] == [1, 2]
    for a, b in zip(small_rows, big_rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-5)
    assert_states_equal(small.model.state_dict(), big.model.state_dict(), atol=1e-5)


def test_step_loss_is_token_weighted_not_mean_of_means(tmp_path, make_toy):
    """The logged step-1 loss equals (sum of target losses) / (targets) recomputed from the initial model."""
    captured = {}

    def snapshot(recipe):
        captured["state"] = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
        captured["batches"] = list(recipe.dataloader)[:4]

    config = make_toy(step_scheduler={"max_steps": 1, "grad_accumulation_steps": 4},
                      dataloader={"batch_size": 2, "shuffle": False}, checkpoint={"enabled": False})
    recipe = train_inprocess(config, recipe=ToyRecipe, before_run=snapshot)
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


class PartsRecipe(ToyRecipe):
    """The toy loss split in two named parts: the squared error of the first half of the targets and the rest."""

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        error = (model(batch["x"]) - batch["y"]) ** 2 * batch["mask"]
        half = error.shape[0] // 2
        first, rest = error[:half].sum(), error[half:].sum()
        self.add_loss_part("first", first)
        self.add_loss_part("rest", rest)
        return first + rest


def test_named_loss_parts_are_logged_per_label_token_of_the_step(tmp_path, make_toy):
    """add_loss_part: each MetricsSample carries loss_<name>, summed over the step's micro-batches and divided by
    its label tokens as loss is, so the parts add up to loss."""
    config = make_toy(step_scheduler={"max_steps": 2, "grad_accumulation_steps": 2},
                      dataloader={"batch_size": 4, "shuffle": False}, checkpoint={"enabled": False})
    train_inprocess(config, recipe=PartsRecipe)
    rows = read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["loss_first"] > 0 and row["loss_rest"] > 0
        assert row["loss_first"] + row["loss_rest"] == pytest.approx(row["loss"], rel=1e-5)
