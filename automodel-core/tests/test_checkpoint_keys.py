"""Upstream's checkpoint keys that are not about resuming: each acts here or is refused with its reason
(``save_consolidated``'s strings, ``model_save_format: torch_save``, ``diffusers_compatible``, ``model_repo_id``,
``model_cache_dir``)."""

from __future__ import annotations

import pytest

from automodel.errors import ConfigError
from automodel.testing import ToyRecipe, checkpoint_dirs, load_config, train_inprocess


def refusal(config, *overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, *overrides, recipe=ToyRecipe)
    assert info.value.exit_code == 2
    return str(info.value)


@pytest.mark.parametrize("value", [True, "true", "every"])
def test_save_consolidated_every_writes_model_in_each_checkpoint(make_toy, tmp_path, value):
    config = make_toy(step_scheduler={"max_steps": 2, "checkpoint_interval": 1},
                      checkpoint={"save_consolidated": value})
    assert load_config(config, recipe=ToyRecipe)[1].checkpoint.save_consolidated is True
    train_inprocess(config, recipe=ToyRecipe)
    root = tmp_path / "ckpt"
    assert checkpoint_dirs(root) == ["epoch_0_step_1", "epoch_0_step_2"]
    assert all((root / name / "model" / "model.safetensors").is_file() for name in checkpoint_dirs(root))


@pytest.mark.parametrize("value, reason", [
    (False, "false asks for checkpoints without the Hugging Face model/ directory, but model/ holds a "
            "checkpoint's only copy of the weights"),
    ("false", "false asks for checkpoints without the Hugging Face model/ directory"),
    ("final", "final (upstream: the Hugging Face model/ only in the last checkpoint, the others holding the "
              "weights sharded) needs a second form of the weights"),
])
def test_save_consolidated_without_model_is_refused_with_the_reason(make_toy, value, reason):
    text = refusal(make_toy(checkpoint={"save_consolidated": value}))
    assert f"checkpoint.save_consolidated: {reason}" in text


def test_save_consolidated_refuses_other_strings(make_toy):
    text = refusal(make_toy(checkpoint={"save_consolidated": "sometimes"}))
    assert "checkpoint.save_consolidated: expected bool | 'every' | 'final' | 'true' | 'false', found str" in text


def test_torch_save_is_refused_saying_why(make_toy):
    text = refusal(make_toy(checkpoint={"model_save_format": "torch_save"}))
    assert "checkpoint.model_save_format: torch_save is upstream's pickle format (torch.save files); a checkpoint " \
           "here is never unpickled, so its weights are always safetensors" in text


@pytest.mark.parametrize("key", ["model_repo_id", "model_cache_dir"])
def test_model_repo_id_and_cache_dir_are_refused_they_never_act_upstream_either(make_toy, key):
    text = refusal(make_toy(checkpoint={key: "meta-llama/Llama-3.2-1B"}))
    assert f"checkpoint.{key}: upstream sets {key} from model: and never reads this value" in text


def test_diffusers_compatible_is_refused_for_a_recipe_that_writes_no_diffusers_pipeline(make_toy):
    text = refusal(make_toy(checkpoint={"diffusers_compatible": True}))
    assert "checkpoint.diffusers_compatible: true, but ToyRecipe writes model/ as a Hugging Face model directory, " \
           "not a diffusers pipeline; remove the key" in text
    load_config(make_toy(checkpoint={"diffusers_compatible": False}), recipe=ToyRecipe)  # what it writes: valid


def test_every_refusal_at_once(make_toy):
    text = refusal(make_toy(checkpoint={"save_consolidated": "final", "model_save_format": "torch_save",
                                        "model_repo_id": "x/y", "model_cache_dir": "/cache"}))
    for key in ("save_consolidated", "model_save_format", "model_repo_id", "model_cache_dir"):
        assert f"checkpoint.{key}: " in text
