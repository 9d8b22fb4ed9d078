"""Upstream's checkpoint keys that are not about resuming: each acts here or is refused with its reason
(``save_consolidated``'s values, ``model_save_format: torch_save`` (the sharded form, in safetensors),
``diffusers_compatible``, ``model_repo_id``, ``model_cache_dir``, ``is_peft``, ``dequantize_base_checkpoint``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from automodel.errors import AutomodelError, ConfigError
from automodel.testing import (
    ToyRecipe,
    assert_states_equal,
    checkpoint_dirs,
    load_config,
    read_jsonl,
    train_inprocess,
)


def refusal(config, *overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, *overrides, recipe=ToyRecipe)
    assert info.value.exit_code == 2
    return str(info.value)


def weights_forms(root: Path) -> dict[str, tuple[str, list[str]]]:
    """checkpoint -> (trainer_state.json's weights, the weight directories it holds)."""
    return {name: (json.loads((root / name / "trainer_state.json").read_text())["weights"],
                   [sub for sub in ("model", "model_shards") if (root / name / sub).is_dir()])
            for name in checkpoint_dirs(root)}


@pytest.mark.parametrize("value", [True, "true", "every"])
def test_save_consolidated_every_writes_model_in_each_checkpoint(make_toy, tmp_path, value):
    config = make_toy(step_scheduler={"max_steps": 2, "checkpoint_interval": 1},
                      checkpoint={"save_consolidated": value})
    assert load_config(config, recipe=ToyRecipe)[1].checkpoint.consolidated() is True
    train_inprocess(config, recipe=ToyRecipe)
    root = tmp_path / "ckpt"
    assert weights_forms(root) == {"epoch_0_step_1": ("model", ["model"]), "epoch_0_step_2": ("model", ["model"])}
    assert all((root / name / "model" / "model.safetensors").is_file() for name in checkpoint_dirs(root))


@pytest.mark.parametrize("value", [False, "false"])
def test_save_consolidated_false_keeps_only_the_shards(make_toy, tmp_path, value):
    config = make_toy(step_scheduler={"max_steps": 2, "checkpoint_interval": 1},
                      checkpoint={"save_consolidated": value})
    train_inprocess(config, recipe=ToyRecipe)
    assert weights_forms(tmp_path / "ckpt") == {"epoch_0_step_1": ("model_shards", ["model_shards"]),
                                                "epoch_0_step_2": ("model_shards", ["model_shards"])}


def test_save_consolidated_final_shards_until_the_last_checkpoint_which_holds_model(make_toy, tmp_path):
    """Upstream's default: the Hugging Face model/ only in the run's last checkpoint; a resume from an earlier
    one reads its shards and trains on exactly as the uninterrupted run did."""
    config = make_toy(step_scheduler={"max_steps": 4, "checkpoint_interval": 2},
                      checkpoint={"save_consolidated": "final"})
    reference = train_inprocess(config, recipe=ToyRecipe)
    root = tmp_path / "ckpt"
    assert weights_forms(root) == {"epoch_0_step_2": ("model_shards", ["model_shards"]),
                                   "epoch_0_step_4": ("model", ["model"])}
    resumed = train_inprocess(config, "--checkpoint.checkpoint_dir", tmp_path / "again", "--restore_from.path",
                              root / "epoch_0_step_2", recipe=ToyRecipe)
    assert weights_forms(tmp_path / "again") == {"epoch_0_step_4": ("model", ["model"])}
    first = {r["step"]: r["loss"] for r in read_jsonl(root / "training.jsonl")}
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "again" / "training.jsonl")] == \
        [(3, first[3]), (4, first[4])]
    assert_states_equal(resumed.model.state_dict(), reference.model.state_dict())


def test_save_consolidated_final_ends_with_model_when_num_epochs_ends_the_run(make_toy, tmp_path):
    # 64 rows at batch 4 with 4 micro-batches per step: 4 steps per epoch, so one epoch ends the run at step 4
    config = make_toy(step_scheduler={"max_steps": 100, "num_epochs": 1, "grad_accumulation_steps": 4,
                                      "checkpoint_interval": 3},
                      checkpoint={"save_consolidated": "final"})
    train_inprocess(config, recipe=ToyRecipe)
    assert weights_forms(tmp_path / "ckpt") == {"epoch_0_step_3": ("model_shards", ["model_shards"]),
                                                "epoch_0_step_4": ("model", ["model"])}


class OwnLayoutToy(ToyRecipe):
    """A toy whose model/ is a layout of its own (as the diffusion and retrieval recipes' are)."""

    def save_model(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "own_layout.json").write_text(json.dumps(sorted(state_dict or self.model.state_dict())))


def test_save_consolidated_final_for_a_recipe_with_its_own_layout_says_every_checkpoint_holds_model(
        make_toy, tmp_path, capsys):
    config = make_toy(step_scheduler={"max_steps": 2, "checkpoint_interval": 1},
                      checkpoint={"save_consolidated": "final"})
    train_inprocess(config, recipe=OwnLayoutToy)
    assert "note: checkpoint.save_consolidated: final: OwnLayoutToy writes model/ in a layout of its own, with no " \
           "sharded form, so every checkpoint holds model/, the last one too" in capsys.readouterr().err
    root = tmp_path / "ckpt"
    assert all((root / name / "model" / "own_layout.json").is_file() for name in checkpoint_dirs(root))
    with pytest.raises(ConfigError, match="checkpoint.save_consolidated: false: OwnLayoutToy writes model/ in a "
                                          "layout of its own, which has no sharded form; remove the key \\(or set it "
                                          "to true\\)"):
        load_config(make_toy(checkpoint={"save_consolidated": False}), recipe=OwnLayoutToy)
    with pytest.raises(ConfigError, match="checkpoint.model_save_format: torch_save: OwnLayoutToy writes model/ in a "
                                          "layout of its own, which has no sharded form; remove the key \\(or set it "
                                          "to safetensors\\)"):
        load_config(make_toy(checkpoint={"model_save_format": "torch_save"}), recipe=OwnLayoutToy)


def test_save_consolidated_refuses_other_strings(make_toy):
    text = refusal(make_toy(checkpoint={"save_consolidated": "sometimes"}))
    assert "checkpoint.save_consolidated: expected bool | 'every' | 'final' | 'true' | 'false' | null, found str" \
        in text


@pytest.mark.parametrize("consolidated", [{}, {"save_consolidated": False}])
def test_torch_save_keeps_only_the_shards_in_safetensors_and_resumes_exactly(make_toy, tmp_path, consolidated):
    """Upstream's torch_save writes the sharded form instead of model/ (save_consolidated unset or false, as its
    examples have it): here the same sharded form, its files safetensors and JSON (nothing pickled)."""
    config = make_toy(step_scheduler={"max_steps": 4, "checkpoint_interval": 2},
                      checkpoint={"model_save_format": "torch_save", **consolidated})
    assert load_config(config, recipe=ToyRecipe)[1].checkpoint.consolidated() is False
    reference = train_inprocess(config, recipe=ToyRecipe)
    root = tmp_path / "ckpt"
    assert weights_forms(root) == {"epoch_0_step_2": ("model_shards", ["model_shards"]),
                                   "epoch_0_step_4": ("model_shards", ["model_shards"])}
    suffixes = {path.suffix for path in (root / "epoch_0_step_4").rglob("*") if path.is_file()}
    assert suffixes <= {".safetensors", ".json", ".yaml"}, suffixes
    resumed = train_inprocess(config, "--checkpoint.checkpoint_dir", tmp_path / "again", "--restore_from.path",
                              root / "epoch_0_step_2", recipe=ToyRecipe)
    first = {r["step"]: r["loss"] for r in read_jsonl(root / "training.jsonl")}
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "again" / "training.jsonl")] == \
        [(3, first[3]), (4, first[4])]
    assert_states_equal(resumed.model.state_dict(), reference.model.state_dict())


@pytest.mark.parametrize("value", [True, "every", "final"])
def test_torch_save_beside_a_consolidated_model_is_refused(make_toy, value):
    text = refusal(make_toy(checkpoint={"model_save_format": "torch_save", "save_consolidated": value}))
    assert f"checkpoint.save_consolidated: {str(value).lower()}: writes model/ in the Hugging Face layout, but " \
           "model_save_format: torch_save keeps the weights only in the sharded form (upstream then ignores " \
           "save_consolidated); remove one of the two" in text


@pytest.mark.parametrize("key, value, section", [("model_repo_id", "meta-llama/Llama-3.2-1B", "model:"),
                                                 ("model_cache_dir", "/cache", "model:"),
                                                 ("is_peft", True, "peft:"), ("is_peft", False, "peft:")])
def test_keys_upstream_fills_from_other_sections_are_refused(make_toy, key, value, section):
    """Upstream overwrites them from model: / peft: whatever the YAML says; here those sections decide too."""
    text = refusal(make_toy(checkpoint={key: value}))
    assert f"checkpoint.{key}: upstream sets {key} from {section} and never reads this value" in text


def test_diffusers_compatible_is_refused_for_a_recipe_that_writes_no_diffusers_pipeline(make_toy):
    text = refusal(make_toy(checkpoint={"diffusers_compatible": True}))
    assert "checkpoint.diffusers_compatible: true, but ToyRecipe writes model/ as a Hugging Face model directory, " \
           "not a diffusers pipeline; remove the key" in text
    load_config(make_toy(checkpoint={"diffusers_compatible": False}), recipe=ToyRecipe)  # what it writes: valid


class QuantizedBaseToy(ToyRecipe):
    """A toy whose base model's config says it is quantized (as an FP8 checkpoint's config.json does)."""

    def build_model(self, ctx):
        model = super().build_model(ctx)
        model.config = SimpleNamespace(quantization_config={"quant_method": "fp8"})
        return model


@pytest.mark.parametrize("value", [True, False])
def test_dequantize_base_checkpoint_is_checked_against_the_base_model(make_toy, capsys, value):
    config = make_toy(step_scheduler={"max_steps": 1}, checkpoint={"dequantize_base_checkpoint": value})
    train_inprocess(config, recipe=ToyRecipe)
    assert f"note: checkpoint.dequantize_base_checkpoint: {str(value).lower()} governs nothing this run: the base " \
           "model is not quantized" in capsys.readouterr().err
    with pytest.raises(AutomodelError, match=f"checkpoint.dequantize_base_checkpoint: {str(value).lower()}, but the "
                                             "base model is quantized \\(quantization_config, quant_method fp8\\)"):
        train_inprocess(config, recipe=QuantizedBaseToy, setup_only=True)


def test_dequantize_base_checkpoint_unset_says_nothing(make_toy, capsys):
    train_inprocess(make_toy(step_scheduler={"max_steps": 1}), recipe=QuantizedBaseToy, setup_only=True)
    assert "dequantize_base_checkpoint" not in capsys.readouterr().err


def test_every_refusal_at_once(make_toy):
    text = refusal(make_toy(checkpoint={"model_save_format": "torch_save", "save_consolidated": True,
                                        "model_repo_id": "x/y", "model_cache_dir": "/cache", "is_peft": True}))
    for key in ("save_consolidated", "model_repo_id", "model_cache_dir", "is_peft"):
        assert f"checkpoint.{key}: " in text


@pytest.mark.parametrize("key, value, needle", [
    ("wait_for_staging", True, "always finishes its host copies before training goes on"),
    ("cpu_offload", True, "there is no separate offload step"),
    ("allow_legacy_pickle_restore", True, "a checkpoint here is never unpickled"),
    ("single_rank_consolidation", True, "no rank gathers the whole model"),
    ("v4_compatible", True, "this model has none to copy"),  # acts for a pretrained model: test_v4_compatible.py
    ("staging_dir", "/tmp/stage", "there is no other staging directory"),
    ("original_model_root_dir", "/models/base", "come from the model trained"),
    ("best_metric_key", "val_loss", "no best-checkpoint pointer"),
    ("consolidation_timeout_minutes", 5, "dist_env.timeout_minutes"),
    ("skip_task_head_prefixes_for_base_model", ["score"], "sequence-classification recipe"),
    ("model_state_dict_keys", ["a"], "upstream fills it itself"),
])
def test_upstreams_other_checkpoint_keys_are_refused_with_their_reason(make_toy, key, value, needle):
    """Never "unknown key" for a key upstream's CheckpointingConfig documents; its default is what happens here."""
    assert f"checkpoint.{key}: " in (text := refusal(make_toy(checkpoint={key: value}))) and needle in text
    default = False if isinstance(value, bool) else None
    load_config(make_toy(checkpoint={key: default}), recipe=ToyRecipe)


def test_upstreams_names_of_async_save_and_keep_last_act(make_toy):
    _, config = load_config(make_toy(checkpoint={"is_async": True, "max_recent_checkpoints": 2}), recipe=ToyRecipe)
    assert config.checkpoint.async_save is True and config.checkpoint.keep_last == 2
