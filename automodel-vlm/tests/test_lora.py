"""LoRA on the language model through the PEFT stage: only adapters train, and the run leaves a peft adapter."""

from __future__ import annotations

import json

import pytest
import torch
from vlm_testing import LLAVA_CONFIG, clone_state, train_inprocess, write_config

from automodel.testing import checkpoint_dirs, read_jsonl

LORA = {"peft": {"dim": 4, "alpha": 8, "match_all_linear": True},
        "step_scheduler": {"max_steps": 6, "val_check_interval": 6, "checkpoint_interval": 6},
        "optimizer": {"lr": 1.0e-2}}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    config = write_config(root / "cfg.yaml", root / "ckpt", **LORA)
    initial = {}
    recipe = train_inprocess(config, before_run=lambda r: initial.update(clone_state(r.model)))
    return {"recipe": recipe, "ckpt": root / "ckpt", "initial": initial, "final": clone_state(recipe.model),
            "config": config}


def test_lora_trains_only_language_model_adapters(lora_run):
    recipe, initial, final = lora_run["recipe"], lora_run["initial"], lora_run["final"]
    trainable = [n for n, p in recipe.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(".language_model." in n for n in trainable), "adapters outside the language model"
    assert not any(".vision_tower." in n or "multi_modal_projector" in n for n, _ in recipe.model.named_parameters()
                   if "lora_" in n)
    for key in initial:
        changed = not torch.equal(initial[key], final[key])
        assert changed == ("lora_B" in key or "lora_A" in key), f"{key}: changed={changed}"
    losses = [r["loss"] for r in read_jsonl(lora_run["ckpt"] / "training.jsonl")]
    assert len(losses) == 6 and losses[-1] < losses[0]
    # eval_generation answered through the peft-wrapped model
    assert json.loads((lora_run["ckpt"] / "eval_generation.json").read_text())["num_questions"] == 8


@pytest.mark.smoke
def test_lora_checkpoint_is_a_peft_adapter_loadable_by_peft(lora_run):
    import peft
    from transformers import AutoProcessor

    from automodel_vlm import AutoModelForImageTextToText

    assert checkpoint_dirs(lora_run["ckpt"]) == ["epoch_0_step_6"]
    model_dir = lora_run["ckpt"] / "epoch_0_step_6" / "model"
    names = {p.name for p in model_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "processor_config.json"} <= names
    assert "model.safetensors" not in names, "a LoRA run saves the adapter, not the whole model"
    adapter = json.loads((model_dir / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8
    assert adapter["target_modules"] and all("language_model" in t for t in adapter["target_modules"])

    # The example's base model is reproducible (model.seed), so peft can put the adapter back on it.
    base = AutoModelForImageTextToText.from_config(str(LLAVA_CONFIG), seed=1234)
    loaded = peft.PeftModel.from_pretrained(base, str(model_dir))
    processor = AutoProcessor.from_pretrained(str(model_dir))
    batch = lora_run["recipe"].default_collate_fn(False)([lora_run["recipe"].train_dataset[i] for i in range(2)])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        theirs = loaded.eval()(**inputs).logits
        ours = lora_run["recipe"].model.eval()(**inputs).logits
        with loaded.disable_adapter():
            plain = loaded(**inputs).logits
    lora_run["recipe"].model.train()
    assert torch.allclose(theirs, ours, atol=1e-6), "peft's model computes something else"
    merged = loaded.merge_and_unload()
    with torch.no_grad():
        assert torch.allclose(merged(**inputs).logits, ours, atol=1e-5)
    assert not torch.allclose(plain, ours), "the adapter changes nothing"
    assert processor.image_token_id == lora_run["recipe"].processor.image_token_id


def test_export_merges_the_adapter_into_its_base_with_the_processor(lora_run, tmp_path, capsys):
    """``automodel export`` rebuilds the base as training did (the checkpoint's config.yaml names the VLM recipe)
    and merges the language model's adapter with the recipe's own LoRA stage."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from automodel.cli.main import main

    out = tmp_path / "merged"
    assert main(["export", str(lora_run["ckpt"]), str(out)]) == 0, capsys.readouterr().err
    assert f"load with AutoModelForImageTextToText.from_pretrained('{out}')" in capsys.readouterr().out
    merged = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert not any("lora_" in name for name in merged.state_dict())
    recipe = lora_run["recipe"]
    batch = recipe.default_collate_fn(False)([recipe.train_dataset[i] for i in range(2)])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        ours = recipe.model.eval()(**inputs).logits
        theirs = merged(**inputs).logits
    recipe.model.train()
    assert torch.allclose(theirs, ours, atol=1e-5)
    assert AutoProcessor.from_pretrained(out).image_token_id == recipe.processor.image_token_id


def test_lora_resume_restores_the_adapter(lora_run, tmp_path):
    recipe = train_inprocess(lora_run["config"], "--checkpoint.checkpoint_dir", tmp_path / "again",
                             "--restore_from.path", lora_run["ckpt"] / "epoch_0_step_6",
                             "--step_scheduler.max_steps", "6", setup_only=True)
    state = clone_state(recipe.model)
    for key, value in lora_run["final"].items():
        assert torch.equal(state[key], value), key
