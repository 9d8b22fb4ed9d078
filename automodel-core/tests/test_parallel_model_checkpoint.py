"""Sharded checkpoints across layouts: written under tp=2, dp=2 x tp=2 and pp=2 (each rank holding only its stage),
resumed by one process, by dp=2 / dp=4 and by pp=2 with the uninterrupted run's losses; their HF exports load in
transformers equal to the single-process weights after the same steps."""

from __future__ import annotations

import json

import pytest
import torch
from model_parallel_workers import RESUMED, STEPS, Place, model_runner, mp_config, train
from parallel_workers import local_model

from automodel.training.parallel.sharded_checkpoint import load_sharded_state

RTOL, WEIGHTS_ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def runs(model_parallel_ranks):
    return model_parallel_ranks


def resumed_in_one_process(checkpoint, tied):
    model = local_model(mp_config(tied=tied), seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_sharded_state(checkpoint, model, optimizer)
    return train(model_runner(model), list(model.parameters()), [optimizer], Place(), RESUMED, STEPS, 2)["losses"]


@pytest.mark.parametrize(("checkpoint", "tied"), [("two/tp_ckpt", True), ("four/dp2_tp2_ckpt", True),
                                                  ("two/pp_ckpt", False)])
def test_a_checkpoint_resumes_in_one_process(runs, checkpoint, tied):
    expected = runs["tied" if tied else "untied"]["losses"][STEPS:]
    assert resumed_in_one_process(runs["dir"] / checkpoint, tied) == pytest.approx(expected, rel=RTOL)


def test_tp2_resumes_on_dp2_and_dp2_x_tp2_on_dp4(runs):
    expected = runs["tied"]["losses"][STEPS:]
    assert runs["two"][0]["tp_to_dp2"]["losses"] == pytest.approx(expected, rel=RTOL)
    assert runs["four"][0]["dp2_tp2_to_dp4"]["losses"] == pytest.approx(expected, rel=RTOL)


def test_pp2_resumes_on_pp2(runs):
    assert runs["two"][0]["pp_1f1b"]["resumed"] == pytest.approx(runs["untied"]["losses"][STEPS:], rel=RTOL)


@pytest.mark.parametrize(("exported", "tied"), [("two/tp_ckpt_model", True), ("two/pp_ckpt_model", False)])
def test_the_hf_export_loads_in_transformers_equal_to_one_process(runs, exported, tied):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runs["dir"] / exported)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    expected = runs["tied_state" if tied else "untied_state"]
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=WEIGHTS_ATOL, msg=key)


def test_a_pipeline_checkpoint_lists_every_stages_tensors(runs):
    checkpoint = runs["dir"] / "two" / "pp_ckpt"
    shapes = json.loads((checkpoint / "tensors.json").read_text())["shapes"]
    names = {key.removeprefix("model.") for key in shapes if key.startswith("model.")}
    assert names == set(runs["untied_state"])  # first stage's embedding, last stage's head, every layer
    manifest = json.loads((checkpoint / "optimizer.json").read_text())
    params = manifest["param_groups"][0]["params"]
    assert "model.embed_tokens.weight" in params and "lm_head.weight" in params and len(params) == len(names)
    first_stage = runs["two"][0]["pp_1f1b"]["names"]
    assert "lm_head.weight" not in first_stage and "model.layers.1.mlp.up_proj.weight" in first_stage
    assert {p.name.split("-")[1] for p in checkpoint.glob("shard-*.safetensors")} == {"00001", "00002"}
