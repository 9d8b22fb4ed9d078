"""The embedded example ``vlm/tiny_llava`` trains on a CPU (test-sized), and what it leaves behind.

One 24-step run (64 training rows at batch 8: three epochs, shuffled; validation every 8 steps; a checkpoint every 4)
is shared by the tests of this module; the resume test restores its mid-epoch step-12 checkpoint.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from vlm_testing import LLAVA_CONFIG, SHAPES, clone_state, train_inprocess, write_config

from automodel.testing import checkpoint_dirs, read_jsonl

RUN = {"step_scheduler": {"checkpoint_interval": 4}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_llava")
    config = write_config(root / "cfg.yaml", root / "ckpt", **RUN)
    initial = {}
    recipe = train_inprocess(config, before_run=lambda r: initial.update(clone_state(r.model)))
    return {"config": config, "ckpt": root / "ckpt", "recipe": recipe, "initial": initial,
            "final": clone_state(recipe.model),
            "losses": {r["step"]: r["loss"] for r in read_jsonl(root / "ckpt" / "training.jsonl")}}


@pytest.mark.smoke
def test_example_trains_and_validation_loss_falls(run):
    ckpt = run["ckpt"]
    assert checkpoint_dirs(ckpt) == [f"epoch_{(s - 1) // 8}_step_{s}" for s in (4, 8, 12, 16, 20, 24)]
    assert (ckpt / "LATEST").read_text().strip() == "epoch_2_step_24"
    val = read_jsonl(ckpt / "validation.jsonl")
    assert [r["step"] for r in val] == [8, 16, 24]
    losses = [r["val_loss"] for r in val]
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] > losses[1] > losses[2], f"validation loss does not fall: {losses}"
    assert losses[-1] < 0.75 * losses[0]
    # The loss is on the answers only: one word + eos + newline per validation row.
    assert val[0]["num_label_tokens"] == 16 * 3
    train = run["losses"]
    assert sorted(train) == list(range(1, 25))
    assert train[1] > 5.0 and train[24] < 0.5 * train[1]  # from ~ln(vocab) down
    generation = json.loads((ckpt / "eval_generation.json").read_text())
    assert generation["num_questions"] == 8 and 0.0 <= generation["exact_match"] <= 1.0


def test_default_freeze_keeps_vision_tower_bitwise_and_trains_the_rest(run):
    initial, final = run["initial"], run["final"]
    vision = [k for k in initial if ".vision_tower." in k]
    language = [k for k in initial if ".language_model." in k or k.startswith("lm_head.")]
    projector = [k for k in initial if ".multi_modal_projector." in k]
    assert vision and language and projector and len(vision) + len(language) + len(projector) == len(initial)
    for key in vision:
        assert torch.equal(initial[key], final[key]), f"{key} changed although freeze.vision_tower is true"
    for key in language + projector:
        assert not torch.equal(initial[key], final[key]), f"{key} did not train"
    params = dict(run["recipe"].model.named_parameters())
    assert not any(params[k].requires_grad for k in vision)
    assert all(params[k].requires_grad for k in language + projector)


@pytest.mark.smoke
def test_checkpoint_loads_with_auto_classes_and_generates_from_an_image(run):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor, LlavaForConditionalGeneration, LlavaProcessor

    model_dir = run["ckpt"] / "epoch_2_step_24" / "model"
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json"} <= \
        {p.name for p in model_dir.iterdir()}
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    processor = AutoProcessor.from_pretrained(str(model_dir))
    assert isinstance(model, LlavaForConditionalGeneration) and isinstance(processor, LlavaProcessor)
    assert json.loads((model_dir / "config.json").read_text())["vision_config"]["image_size"] == \
        json.loads(LLAVA_CONFIG.read_text())["vision_config"]["image_size"]
    loaded = model.state_dict()
    assert loaded.keys() == run["final"].keys()
    for key, value in run["final"].items():  # the trained weights, the vision tower's still the initial ones
        assert torch.equal(loaded[key], value), key
    model.eval()
    row = read_jsonl(SHAPES / "validation.jsonl")[0]
    image = Image.open(SHAPES / row["image"]).convert("RGB")
    prompt = processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
    assert prompt.endswith("assistant:") and prompt.count("<image>") == 1
    inputs = processor(text=[prompt], images=[image], return_tensors="pt", add_special_tokens=False)
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 16  # one token per 8x8 patch
    with torch.no_grad():
        ours = run["recipe"].model.eval()(**inputs).logits
        theirs = model(**inputs).logits
        run["recipe"].model.train()
        assert torch.equal(ours, theirs), "the reloaded model computes something else"
        out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=1, do_sample=False,
                             pad_token_id=processor.tokenizer.pad_token_id)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 3
    assert isinstance(processor.decode(new, skip_special_tokens=True), str)
    # a different image changes what the model sees
    other = Image.new("RGB", (32, 32), (0, 0, 255))
    with torch.no_grad():
        changed = model(**processor(text=[prompt], images=[other], return_tensors="pt",
                                    add_special_tokens=False)).logits
    assert not torch.equal(changed, theirs)


def test_fine_tuning_on_from_a_checkpoint_takes_its_processor(run, make_config):
    """``model.pretrained_model_name_or_path`` = a checkpoint's model/ and no processor section: both load from it."""
    model_dir = run["ckpt"] / "epoch_2_step_24" / "model"
    config = make_config(processor=None, model={"_target_": "automodel_vlm.AutoModelForImageTextToText.from_pretrained",
                                                "pretrained_model_name_or_path": str(model_dir), "config": None,
                                                "seed": None})
    recipe = train_inprocess(config, setup_only=True)
    assert recipe.processor.image_token_id == run["recipe"].processor.image_token_id
    assert recipe.processor.chat_template == run["recipe"].processor.chat_template
    state = recipe.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in run["final"].items())


def test_resume_mid_epoch_is_exact(run, tmp_path):
    source = run["ckpt"] / "epoch_1_step_12"
    recipe = train_inprocess(run["config"], "--checkpoint.checkpoint_dir", tmp_path / "resumed",
                             "--restore_from.path", source)
    assert recipe.step_scheduler.step == 24
    rows = read_jsonl(tmp_path / "resumed" / "training.jsonl")
    assert [r["step"] for r in rows] == list(range(13, 25))
    assert [r["loss"] for r in rows] == [run["losses"][s] for s in range(13, 25)], "losses after resume differ"
    final = clone_state(recipe.model)
    assert final.keys() == run["final"].keys()
    for key in final:
        assert torch.equal(final[key], run["final"][key]), key
    val = [r["val_loss"] for r in read_jsonl(tmp_path / "resumed" / "validation.jsonl")]
    assert val == [r["val_loss"] for r in read_jsonl(run["ckpt"] / "validation.jsonl")][1:]


def test_resume_with_a_trainable_vision_tower_is_exact(tmp_path):
    """Llava reads the tower's hidden states, not its final layer norm: a trainable tower has parameters that never
    get a gradient (so no optimizer state), and a resume must still continue exactly."""
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ref", freeze={"vision_tower": False},
                          step_scheduler={"max_steps": 12, "checkpoint_interval": 6, "val_check_interval": 100},
                          eval_generation={"enabled": False})
    reference = train_inprocess(config)
    unused = [n for n, p in reference.model.named_parameters()
              if p.requires_grad and p not in reference.optimizer.state]
    assert unused and all(".vision_tower.post_layernorm." in n for n in unused)
    resumed = train_inprocess(config, "--checkpoint.checkpoint_dir", tmp_path / "resumed",
                              "--restore_from.path", tmp_path / "ref" / "epoch_0_step_6")
    ref_losses = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "ref" / "training.jsonl")}
    got = read_jsonl(tmp_path / "resumed" / "training.jsonl")
    assert [r["loss"] for r in got] == [ref_losses[s] for s in range(7, 13)]
    final, expected = clone_state(resumed.model), clone_state(reference.model)
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_logits_at_label_positions_only_change_nothing_but_the_work(tmp_path):
    """The default (`logits.label_positions_only: true`) projects only the assistant-token positions through the
    LM head; the losses and trained weights are those of computing logits at every position."""
    runs = {}
    for on in (True, False):
        name = "labels" if on else "every"
        config = write_config(tmp_path / f"{name}.yaml", tmp_path / name, logits={"label_positions_only": on},
                              step_scheduler={"max_steps": 4, "checkpoint_interval": 100, "val_check_interval": 4},
                              eval_generation={"enabled": False})
        recipe = train_inprocess(config)
        assert (recipe.head_positions is not None) == on
        runs[on] = (recipe, read_jsonl(tmp_path / name / "training.jsonl"),
                    read_jsonl(tmp_path / name / "validation.jsonl"))
    (on, on_rows, on_val), (off, off_rows, off_val) = runs[True], runs[False]
    assert len(on_rows) == len(off_rows) == 4 and len(on_val) == len(off_val) == 1
    assert [r["loss"] for r in on_rows] == pytest.approx([r["loss"] for r in off_rows], rel=1e-5)
    assert on_val[0]["val_loss"] == pytest.approx(off_val[0]["val_loss"], rel=1e-5)
    final, expected = clone_state(on.model), clone_state(off.model)
    assert all(torch.allclose(final[k], expected[k], atol=1e-5) for k in expected)


def test_upstream_torch_save_keeps_the_shards_and_export_names_the_class_that_loads_them(tmp_path, capsys):
    """Upstream's ``model_save_format: torch_save``: the checkpoint holds the sharded form alone; ``automodel export``
    writes the Hugging Face model and names ``AutoModelForImageTextToText`` (a Llava is no causal LM to transformers'
    AutoModelForCausalLM), which loads the trained weights."""
    from transformers import AutoModelForImageTextToText

    from automodel.cli.main import main

    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", step_scheduler={"max_steps": 2},
                          checkpoint={"model_save_format": "torch_save"})
    recipe = train_inprocess(config)
    saved = tmp_path / "ckpt" / "epoch_0_step_2"
    assert (saved / "model_shards").is_dir() and not (saved / "model").exists()
    capsys.readouterr()
    assert main(["export", str(saved), str(tmp_path / "exported")]) == 0
    assert f"load with AutoModelForImageTextToText.from_pretrained('{tmp_path / 'exported'}')" in \
        capsys.readouterr().out
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "exported").state_dict()
    trained = recipe.model.state_dict()
    assert loaded.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key
