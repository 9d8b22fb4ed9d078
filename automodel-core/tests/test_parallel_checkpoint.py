"""Sharded checkpoints (DCP, safetensors + JSON) written by two gloo ranks and by one process: restores reshard
2 -> 2, 2 -> 1 (no process group), 1 -> 2 with the uninterrupted run's losses; the HF export loads in transformers
and in peft equal to the gathered weights; async save; reading never unpickles; broken input fails clearly."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from parallel_workers import full_state, local_model, tiny_config, train
from safetensors.torch import load_file

from automodel.errors import AutomodelError
from automodel.training.parallel.hf_export import export_hf
from automodel.training.parallel.sharded_checkpoint import (
    ShardedCheckpointError,
    load_sharded_state,
    save_sharded_state,
)


@pytest.fixture(scope="module")
def run(two_ranks):
    return {"dir": two_ranks["dir"] / "checkpoint", "one": two_ranks["one_process"],
            "ranks": [rank["checkpoint"] for rank in two_ranks["ranks"]]}


def gathered(run, name):
    return load_file(str(run["dir"] / f"{name}.safetensors"))


def test_two_ranks_write_their_own_shards_in_bounded_files(run):
    files = sorted(p.name for p in (run["dir"] / "two").glob("*.safetensors"))
    assert {name.split("-")[1] for name in files} == {"00001", "00002"}  # shard-<rank>-model-<k>-of-<n>
    assert len(files) > 2
    manifest = json.loads((run["dir"] / "two" / "optimizer.json").read_text())
    assert manifest["param_groups"][0]["lr"] == 1e-2 and manifest["param_groups"][0]["betas"] == [0.9, 0.999]


def test_resume_on_two_ranks_gives_the_uninterrupted_losses(run):
    ranks = run["ranks"][0]
    assert ranks["steps_1_2"] == pytest.approx(run["one"]["steps_1_2"], abs=1e-5)
    assert ranks["resumed_3_4"] == ranks["steps_3_4"]  # bitwise: same ranks, same shards


def test_a_one_process_checkpoint_resumes_on_two_ranks(run):
    assert run["ranks"][0]["from_one_process_3_4"] == pytest.approx(run["one"]["steps_3_4"], abs=1e-5)


def test_a_two_rank_checkpoint_resumes_in_one_process_without_unpickling(run, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint read unpickled")

    model = local_model(tiny_config(), seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    load_sharded_state(run["dir"] / "two", model, optimizer)
    monkeypatch.undo()
    assert train(model, 2, first_step=2, optimizer=optimizer) == pytest.approx(run["ranks"][0]["steps_3_4"], abs=1e-5)
    assert isinstance(optimizer.param_groups[0]["betas"], tuple)


def test_hf_export_loads_in_transformers_equal_to_the_gathered_weights(run):
    from transformers import AutoModelForCausalLM

    exported = run["dir"] / "two_model"
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]  # tied once
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = gathered(run, "step2")
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_lora_export_loads_in_peft_equal_to_the_gathered_adapter(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exported = run["dir"] / "lora_model"
    assert sorted(p.name for p in exported.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    expected = gathered(run, "lora_step2")
    base = AutoModelForCausalLM.from_config(tiny_config())
    base.load_state_dict({k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
                          for k, v in expected.items() if "lora_" not in k}, strict=False)
    model = PeftModel.from_pretrained(base, exported)
    adapters = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(adapters) == 2 * 2 * 3  # A and B of q_proj and v_proj in three layers
    for key, value in adapters.items():
        assert torch.equal(value, expected[key]), key
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k)  # trained, not the zero init


def test_async_save_finishes_while_training_goes_on(run):
    assert len(run["ranks"][0]["step_5_during_async_save"]) == 1
    restored = gathered(run, "async_step4")
    for key, value in gathered(run, "step4").items():
        assert torch.equal(restored[key], value), key


def test_export_in_one_process_matches_the_export_by_two_ranks(run, tmp_path):
    export_hf(run["dir"] / "two", tmp_path / "model", max_file_bytes=20_000)
    for file in sorted((run["dir"] / "two_model").glob("*.safetensors")):
        assert (tmp_path / "model" / file.name).read_bytes() == file.read_bytes()


def test_a_different_model_is_refused_with_the_mismatches(run):
    model = local_model(tiny_config(hidden=48), seed=1)
    with pytest.raises(ShardedCheckpointError, match=r"does not match the model[\s\S]*shape mismatches"):
        load_sharded_state(run["dir"] / "two", model)


def test_broken_checkpoints_fail_clearly(run, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(run["dir"] / "two", broken)
    (broken / "optimizer.json").unlink()
    model = local_model(tiny_config(), seed=1)
    with pytest.raises(ShardedCheckpointError, match="optimizer.json is missing"):
        load_sharded_state(broken, model, torch.optim.AdamW(model.parameters()))
    victim = sorted(broken.glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(ShardedCheckpointError, match="cannot read .* as a checkpoint shard"):
        load_sharded_state(broken, model)
    with pytest.raises(AutomodelError, match="cannot read .* as a checkpoint shard"):
        export_hf(broken, tmp_path / "out")
    with pytest.raises(ShardedCheckpointError, match="is not a sharded checkpoint .tensors.json is missing"):
        load_sharded_state(tmp_path, model)


def test_a_missing_rank_file_is_refused_not_half_loaded(run, tmp_path):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(run["dir"] / "two", incomplete)
    for file in incomplete.glob("shard-00002-*.safetensors"):  # every file rank 1 wrote
        file.unlink()
    with pytest.raises(ShardedCheckpointError, match="holds only part of .*is a shard file missing"):
        load_sharded_state(incomplete, local_model(tiny_config(), seed=1))
    with pytest.raises(AutomodelError, match="holds only part of .*is a shard file missing"):
        export_hf(incomplete, tmp_path / "out")


@pytest.mark.parametrize("tied", [True, False])
def test_one_process_save_and_restore_round_trip(tmp_path, tied):
    model = local_model(tiny_config(tied=tied))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, 1, optimizer=optimizer)
    save_sharded_state(tmp_path / "ckpt", model, optimizer)
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) == 1  # below max_file_bytes: one file
    restored = local_model(tiny_config(tied=tied), seed=3)
    restored_optimizer = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
    load_sharded_state(tmp_path / "ckpt", restored, restored_optimizer)
    expected = full_state(model)
    for key, value in full_state(restored).items():
        assert torch.equal(value, expected[key]), key
    assert train(restored, 1, first_step=1, optimizer=restored_optimizer) == \
        train(model, 1, first_step=1, optimizer=optimizer)
