"""Muon (upstream's dion.Muon) under FSDP2 on two gloo ranks against one process, and its state through the
sharded checkpoint: ``parallel_workers.scenario_muon`` runs in the session's one two-rank launch."""

from __future__ import annotations

import pytest
import torch
from parallel_workers import local_model, muon, tiny_config, train
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def run(two_ranks):
    return {"dir": two_ranks["dir"] / "muon", "ranks": [rank["muon"] for rank in two_ranks["ranks"]]}


def test_two_ranks_train_as_one_process(run):
    initial = local_model(tiny_config(tied=False)).state_dict()
    model = local_model(tiny_config(tied=False))
    losses = train(model, 3, optimizer=muon(model))
    for result in run["ranks"]:
        assert result["steps_1_2"] + result["step_3"] == pytest.approx(losses, rel=1e-4)
    gathered = load_file(str(run["dir"] / "step3.safetensors"))
    assert sorted(gathered) == sorted(initial)
    for name, value in model.state_dict().items():
        # The change of each tensor over the three steps, as in one process up to rounding: the Newton-Schulz
        # iteration runs in bf16 and lifts the gradient's smallest singular directions (rounding there) to the size
        # of the others, so a few matrices differ by up to ~9% (o_proj). Orthogonalising a shard alone, or scaling
        # by a shard's shape, differs by far more.
        change, expected = gathered[name] - initial[name], value - initial[name]
        assert expected.norm() > 0, name
        assert ((change - expected).norm() / expected.norm()).item() < 0.15, name


def test_a_resume_from_the_sharded_checkpoint_continues_exactly(run):
    for result in run["ranks"]:
        assert result["resumed_3"] == result["step_3"]
    resumed, straight = (load_file(str(run["dir"] / f"{name}.safetensors")) for name in ("resumed3", "step3"))
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
