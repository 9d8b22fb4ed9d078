"""A tiny Gemma 3 with transformers' own Gemma3Processor, as a hub checkpoint holds them (upstream's gemma3 configs).

transformers 5's Gemma 3 processor names the start-of-image token as its ``image_token_id`` and expands it to the
start, the image's soft tokens (the model's ``image_token_index``) and the end; the run must take them as belonging
together and label only the answers."""

from __future__ import annotations

import json

from vlm_testing import conversation, tiny_gemma3_dir, tiny_gemma4_dir, train_inprocess, write_config

from automodel import testing
from automodel_vlm.datasets import VLMCollator
from automodel_vlm.processor import load_processor


def _trains_two_steps_with_its_own_processor(model, tmp_path) -> None:
    """The checkpoint ``model`` (no processor: section, so its own processor) trains 2 steps through the recipe."""
    config = write_config(tmp_path / "run.yaml", tmp_path / "ckpt", step_scheduler={"max_steps": 2},
                          processor=None, model={"_target_": "automodel_vlm.AutoModelForImageTextToText."
                                                 "from_pretrained", "pretrained_model_name_or_path": str(model),
                                                 "config": None, "seed": None})
    train_inprocess(config)
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [1, 2]


def test_a_gemma3_checkpoint_with_its_own_processor_trains_and_labels_only_the_answers(tmp_path):
    from PIL import Image

    model = tiny_gemma3_dir(tmp_path / "gemma3")
    processor = load_processor(str(model))
    assert processor.image_token_id != processor.tokenizer.image_token_id  # the case the recipe's check must take
    batch = VLMCollator(processor)([{"messages": conversation("Which colour?", "Red."),
                                     "images": [Image.new("RGB", (16, 16), (200, 30, 30))]}])
    labelled = batch["labels"][batch["labels"] != -100].tolist()
    assert processor.tokenizer.decode(labelled).strip().startswith("Red.")
    assert (batch["input_ids"] == processor.tokenizer.image_token_id).sum() == 4

    _trains_two_steps_with_its_own_processor(model, tmp_path)
    assert json.loads((model / "config.json").read_text())["model_type"] == "gemma3"


def test_another_models_processor_is_still_refused(tmp_path):
    import pytest

    from automodel.errors import AutomodelError

    model = tiny_gemma3_dir(tmp_path / "gemma3")
    config = write_config(tmp_path / "run.yaml", tmp_path / "ckpt",
                          model={"_target_": "automodel_vlm.AutoModelForImageTextToText.from_pretrained",
                                 "pretrained_model_name_or_path": str(model), "config": None, "seed": None})
    with pytest.raises(AutomodelError, match="the processor and model do not belong together"):
        train_inprocess(config, setup_only=True)  # the example's Llava processor


def test_a_gemma4_checkpoint_loads_its_processor_images_only_without_torchvision_and_trains(tmp_path):
    """Gemma 4's processor holds a torchvision-only video processor: without torchvision it loads images-only."""
    import pytest
    from PIL import Image

    from automodel_vlm.processor import has_torchvision

    if has_torchvision():
        pytest.skip("with torchvision transformers loads Gemma 4's processor whole")
    model = tiny_gemma4_dir(tmp_path / "gemma4")
    processor = load_processor(str(model))
    assert type(processor).__name__ == "Gemma4ProcessorImagesOnly"
    batch = VLMCollator(processor)([{"messages": conversation("Which colour?", "Red."),
                                     "images": [Image.new("RGB", (32, 32), (200, 30, 30))]}])
    assert processor.tokenizer.decode(batch["labels"][batch["labels"] != -100].tolist()).strip().startswith("Red.")
    assert (batch["input_ids"] == processor.image_token_id).sum() > 0

    _trains_two_steps_with_its_own_processor(model, tmp_path)
