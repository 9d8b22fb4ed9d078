"""Two gloo ranks with FSDP2 against one process: the device mesh, meta-device materialisation (fresh, from sharded
HF safetensors, HSDP, LoRA, DoRA), fp32 / bf16 / fp16 / DoRA training and activation checkpointing under FSDP2.

``parallel_workers.scenario_fsdp`` produces everything (in the session's one launch); each test checks one
property of it."""

from __future__ import annotations

import pytest
import torch
from parallel_workers import local_model, lora_config, tiny_config, train
from safetensors.torch import load_file

from automodel.training.parallel.precision import resolve_precision


@pytest.fixture(scope="module")
def run(two_ranks):
    from transformers import AutoModelForCausalLM

    assert (two_ranks["base"] / "model.safetensors.index.json").is_file()  # several files, the tied head dropped
    return {"dir": two_ranks["dir"] / "fsdp", "base": two_ranks["base"],
            "reference": AutoModelForCausalLM.from_pretrained(two_ranks["base"]),
            "ranks": [rank["fsdp"] for rank in two_ranks["ranks"]]}


def gathered(run, name):
    return load_file(str(run["dir"] / f"{name}.safetensors"))


def assert_same(state, expected):
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_mesh_has_every_named_dimension_and_the_flattened_dp(run):
    for rank, result in enumerate(run["ranks"]):
        mesh = result["mesh"]
        assert mesh["names"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"] and mesh["shape"] == [1, 2, 1, 1, 1]
        assert mesh["coordinate"] == mesh["layout_coordinate"] == [0, rank, 0, 0, 0]
        assert mesh["dp_size"] == 2 and mesh["dp_rank"] == mesh["layout_dp_rank"] == rank
        assert result["hsdp_placements"] == ["Replicate()", "Shard(dim=0)"]


def test_fresh_init_is_the_same_on_two_ranks_as_in_one_process(run):
    one_process = local_model(tiny_config())
    assert one_process.lm_head.weight is one_process.model.embed_tokens.weight  # the tie survives materialisation
    assert_same(gathered(run, "fresh"), {k: v for k, v in one_process.state_dict().items()})


def test_fresh_init_uses_the_models_initialiser_and_the_seed(run):
    model = local_model(tiny_config(), seed=7)
    state = model.state_dict()
    assert all(torch.isfinite(v).all() for v in state.values())
    assert torch.equal(state["model.norm.weight"], torch.ones(32))  # RMSNorm: ones, as _init_weights sets
    std = state["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - tiny_config().initializer_range) < 0.004  # normal(0, initializer_range)
    reference = run["reference"]  # non-persistent buffers (rotary inv_freq) as the model's constructor made them
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert torch.equal(state["model.layers.1.self_attn.q_proj.weight"],
                       local_model(tiny_config(), seed=7).state_dict()["model.layers.1.self_attn.q_proj.weight"])
    assert not torch.equal(state["model.layers.1.self_attn.q_proj.weight"],
                           local_model(tiny_config(), seed=8).state_dict()["model.layers.1.self_attn.q_proj.weight"])


def test_each_rank_reads_its_slices_of_sharded_safetensors_equal_to_the_files(run):
    expected = run["reference"].state_dict()  # lm_head.weight is tied: not in the files, yet equal after loading
    assert_same(gathered(run, "loaded"), expected)
    assert_same(gathered(run, "hsdp"), expected)
    assert_same({k: v for k, v in local_model(tiny_config(), weights=run["base"]).state_dict().items()}, expected)


def test_lora_on_the_meta_model_loads_the_base_and_initialises_the_adapters(run):
    state = gathered(run, "lora")
    assert_same(state, dict(local_model(tiny_config(), weights=run["base"], lora=True).state_dict()))
    base = run["reference"].state_dict()
    assert torch.equal(state["base_model.model.model.layers.2.self_attn.q_proj.base_layer.weight"],
                       base["model.layers.2.self_attn.q_proj.weight"])
    lora_a = state["base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight"]
    assert lora_a.abs().sum() > 0 and lora_a.shape == (4, 32)  # peft's kaiming init
    assert not state["base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight"].any()  # zeros


def test_dora_magnitudes_on_two_ranks_are_peft_s_from_the_whole_base_weights(run):
    import peft

    state = gathered(run, "dora")
    assert_same(state, dict(local_model(tiny_config(), weights=run["base"], lora="dora").state_dict()))
    peft_built = dict(peft.get_peft_model(run["reference"], lora_config(dora=True)).state_dict())  # whole weights
    magnitudes = [key for key in state if "lora_magnitude_vector" in key]
    assert len(magnitudes) == 6  # q_proj and v_proj of three layers
    for key in magnitudes:
        assert torch.equal(state[key], peft_built[key]), key
    fresh = gathered(run, "dora_fresh")  # a fresh base: the norms of the seeded weights
    weight = fresh["base_model.model.model.layers.1.self_attn.v_proj.base_layer.weight"]
    assert torch.equal(fresh["base_model.model.model.layers.1.self_attn.v_proj.lora_magnitude_vector.default.weight"],
                       torch.linalg.vector_norm(weight, dim=1))


def test_dora_under_fsdp2_trains_like_one_process(run):
    one_process = train(local_model(tiny_config(tied=False), lora="dora"), 3)
    assert run["ranks"][0]["dora_fp32"] == pytest.approx(one_process, abs=1e-5)
    assert one_process[2] < one_process[0]


def test_fp32_fsdp2_matches_one_process(run):
    one_process = train(local_model(tiny_config(tied=False)), 3)
    assert run["ranks"][0]["fp32"] == pytest.approx(one_process, abs=1e-5)
    assert run["ranks"][0]["fp32"] == run["ranks"][1]["fp32"]


def test_activation_checkpointing_under_fsdp2_gives_the_same_losses(run):
    ranks = run["ranks"][0]
    assert ranks["fp32_checkpointed"] == pytest.approx(ranks["fp32"], abs=1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_fsdp2_matches_one_process_autocast(run, dtype):
    precision = resolve_precision({"param_dtype": dtype}, torch.device("cpu"), fsdp2=False)
    one_process = train(local_model(tiny_config(tied=False)), 3, precision)
    two_ranks = run["ranks"][0][dtype]
    assert two_ranks == pytest.approx(one_process, rel=2e-2)
    assert two_ranks != run["ranks"][0]["fp32"]  # the policy acted: bf16 / fp16 compute differs from fp32
