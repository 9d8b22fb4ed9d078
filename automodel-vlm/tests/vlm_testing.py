"""Helpers for the VLM domain's tests: the shipped example with test-sized overrides, in-process runs.

A run here is the example's tiny Llava (CLIP 2x32 + Llama 2x64) on 64 of the shipped shapes images at batch size 8,
a couple of dozen steps: a few seconds on a CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import yaml

from automodel import testing
from automodel.testing import OFFLINE, deep_update, write_yaml

for _name, _value in OFFLINE.items():
    os.environ.setdefault(_name, _value)

PKG_DIR = Path(importlib.util.find_spec("automodel_vlm").submodule_search_locations[0])
EXAMPLE = PKG_DIR / "examples" / "tiny_llava.yaml"
ASSETS = PKG_DIR / "examples" / "assets"
SHAPES = ASSETS / "tiny_shapes"
TOKENIZER_DIR = ASSETS / "tiny_tokenizer"
IMAGE_PROCESSOR_DIR = ASSETS / "tiny_image_processor"
LLAVA_CONFIG = ASSETS / "tiny_llava" / "config.json"

# Test-sized: 64 training rows at batch 8 (an epoch is 8 steps), 16 validation rows.
TEST_OVERRIDES: dict[str, Any] = {
    "step_scheduler": {"max_steps": 24, "val_check_interval": 8, "checkpoint_interval": 8, "log_interval": 1},
    "dataset": {"limit_dataset_samples": 64},
    "validation_dataset": {"limit_dataset_samples": 16},
    "dataloader": {"batch_size": 8},
    "lr_scheduler": {"warmup_steps": 3},
    "checkpoint": {"keep_last": None},
    "eval_generation": {"num_examples": 8, "max_new_tokens": 2},
}


def example_config() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def write_config(path: Path, checkpoint_dir: Path, **sections: Any) -> Path:
    """The example (test-sized; ``sections`` deep-merged on top, None removes) written to ``path``."""
    data = deep_update(deep_update(example_config(), TEST_OVERRIDES), sections)
    data["checkpoint"]["checkpoint_dir"] = str(checkpoint_dir)
    return write_yaml(path, data)


def train_inprocess(config: Path, *overrides: str, before_run=None, setup_only: bool = False):
    """Validate and run ``finetune vlm`` in this process, as the CLI does; returns the recipe."""
    return testing.train_inprocess(config, *overrides, route=("finetune", "vlm"), before_run=before_run,
                                   setup_only=setup_only)


def tiny_processor():
    from automodel_vlm.processor import build_processor

    return build_processor(str(IMAGE_PROCESSOR_DIR), str(TOKENIZER_DIR), processor_class="LlavaProcessor",
                           patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1)


def conversation(question: str, answer: str | None = None, image: Any = None) -> list[dict]:
    part = {"type": "image"} if image is None else {"type": "image", "image": image}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": question}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


# Text-only chat rows in the columns of upstream's Tulu-3 SFT mixture (messages) and Magicoder (problem, solution).
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white")


def tulu_rows(count: int = 24) -> list[dict]:
    """Tulu-3-form rows: a system turn in every third, two user/assistant rounds in every other; the last one has a
    role upstream leaves out (tool) and a media placeholder in the user text (left out too)."""
    rows = []
    for i in range(count):
        colour = COLOURS[i % len(COLOURS)]
        messages = [{"role": "system", "content": "Answer in one word."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"Which colour is number {i}?"},
                     {"role": "assistant", "content": colour.capitalize() + "."}]
        if i % 2:
            messages += [{"role": "user", "content": "And the next?"},
                         {"role": "assistant", "content": COLOURS[(i + 1) % len(COLOURS)] + "."}]
        rows.append({"id": f"row_{i}", "source": "colours", "messages": messages})
    rows[-1]["messages"] = [{"role": "user", "content": "<image> Name a shape."},
                            {"role": "tool", "content": "unused"},
                            {"role": "assistant", "content": "A circle."}]
    return rows


def magicoder_rows(count: int = 6) -> list[dict]:
    """Magicoder-form rows; the last has no solution (the mix leaves it out)."""
    rows = [{"problem": f"Write f returning {i}.", "solution": f"def f():\n    return {i}"} for i in range(count)]
    rows[-1]["solution"] = " "
    return rows


@functools.cache
def images_only_qwen_vl_processor_class() -> type:
    """Qwen2VLProcessor without its video processor (torchvision-backed, not installed here); one class per process,
    so that ``AutoProcessor.register`` can name it for a saved processor."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImagesOnlyQwen2VLProcessor


def tiny_qwen_vl_processor(max_pixels: int = 32 * 32):
    """A Qwen-VL-style processor built offline: the shipped tokenizer with Qwen's vision tokens added, its chat
    template rendering an image as them, and a Pillow Qwen2-VL image processor (32x32 pictures: 4 merged patches;
    larger ones kept up to ``max_pixels``, in 16-pixel steps)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>",
                                                                "<|vision_end|>", "<|video_pad|>"]})
    template = tokenizer.chat_template.replace("'<image>'", "'<|vision_start|><|image_pad|><|vision_end|>'")
    images = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=max_pixels, patch_size=8, merge_size=2,
                                      temporal_patch_size=2)
    return images_only_qwen_vl_processor_class()(image_processor=images, tokenizer=tokenizer, chat_template=template)


def clone_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def saved_model_tensors(model_dir: Path, lora: bool) -> dict:
    """The tensors of a consolidated model/: the adapter's as saved, or the model's as transformers loads them."""
    if lora:
        from safetensors.torch import load_file

        return load_file(model_dir / "adapter_model.safetensors")
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(model_dir).state_dict()


def training_column(out: Path, key: str) -> list[float]:
    """One value of each record a run wrote to training.jsonl."""
    return [row[key] for row in testing.read_jsonl(out / "training.jsonl")]


def assert_trains_like(out: Path, reference: Path, checkpoint: str, lora: bool, steps: int = 4) -> None:
    """``out`` logged the losses and gradient norms of ``reference`` (1e-4 relative, ``steps`` records) and its
    ``checkpoint``'s consolidated model/ (or adapter) holds the reference's tensors (1e-5), under the names the
    reference's files give them (what a resume reads back; transformers' loader would also take other spellings)."""
    import pytest
    from safetensors import safe_open

    assert len(training_column(out, "loss")) == steps
    names = [{key for file in (run / checkpoint / "model").glob("*.safetensors")
              for key in safe_open(file, "pt").keys()} for run in (out, reference)]
    assert names[0] == names[1] and names[1]
    for key in ("loss", "grad_norm"):
        assert training_column(out, key) == pytest.approx(training_column(reference, key), rel=1e-4), key
    got, expected = (saved_model_tensors(run / checkpoint / "model", lora) for run in (out, reference))
    assert got.keys() == expected.keys() and expected
    for key, value in expected.items():
        assert (got[key] - value).abs().max().item() < 1e-5, key


def assert_steps_like_one_process(ran: dict[str, Any], one: dict[str, Any]) -> None:
    """A parallel run's losses, gradient norms and vision-tower gradients (``{losses, norms, vision_grads}``, from
    the distributed workers) equal one process's."""
    import pytest
    import torch

    assert ran["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert ran["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert sorted(ran["vision_grads"]) == sorted(one["vision_grads"]) and one["vision_grads"]
    for key, value in one["vision_grads"].items():
        assert torch.allclose(torch.tensor(ran["vision_grads"][key]), torch.tensor(value), rtol=1e-4, atol=1e-6), key


def tiny_gemma3_dir(path: Path) -> Path:
    """A tiny Gemma 3 (the context-parallel tests' config, fresh weights) saved with transformers' Gemma3Processor:
    the shipped tokenizer with Gemma's image tokens (start, soft token, end), its chat template writing an image as
    the start-of-image token (which the processor expands to start, 4 soft tokens, end), Pillow images of 16 pixels
    (the config's vision tower: 4 tokens an image)."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor
    from vlm_context_parallel_workers import GEMMA_IMAGE_TOKENS, tiny_model

    from automodel_vlm import AutoModelForImageTextToText

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), extra_special_tokens={
        "boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 16, "width": 16}),
                                tokenizer=tokenizer, image_seq_length=GEMMA_IMAGE_TOKENS,
                                chat_template=tokenizer.chat_template.replace("'<image>'", "'<start_of_image>'"))
    config = tiny_model("gemma3")[0].config
    config.text_config.update({"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                               "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    config.image_token_index = tokenizer.image_token_id
    config.boi_token_index, config.eoi_token_index = tokenizer.boi_token_id, tokenizer.eoi_token_id
    AutoModelForImageTextToText.from_config(config, seed=0).save_pretrained(path)
    processor.save_pretrained(str(path))
    return path


def tiny_gemma4_dir(path: Path, **text_config: Any) -> Path:
    """A tiny Gemma 4 (the context-parallel tests' config, ``text_config`` set on its text config; fresh weights)
    saved with transformers' Gemma4Processor
    as this machine loads it without torchvision (images-only, ``automodel_vlm.omni``): the shipped tokenizer with
    Gemma 4's image and audio tokens, its chat template writing an image as the image token, a Pillow Gemma 4 image
    processor of 4-pixel patches pooled 2 x 2 (the config's vision tower) and Gemma 4's audio feature extractor."""
    from transformers import AutoTokenizer, Gemma4ImageProcessorPil
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from vlm_context_parallel_workers import tiny_model

    from automodel_vlm import AutoModelForImageTextToText
    from automodel_vlm.omni import omni_processor_class

    tokens = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>",
              "boa_token": "<|audio>", "audio_token": "<|audio|>", "eoa_token": "<audio|>"}
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), extra_special_tokens=tokens)
    processor = omni_processor_class("Gemma4Processor")(
        image_processor=Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70),
        feature_extractor=Gemma4AudioFeatureExtractor(), tokenizer=tokenizer, image_seq_length=70,
        chat_template=tokenizer.chat_template.replace("'<image>'", "'<|image|>'"))
    config = tiny_model("gemma4")[0].config
    config.text_config.update({"vocab_size": len(tokenizer), "vocab_size_per_layer_input": len(tokenizer),
                               "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                               "pad_token_id": tokenizer.pad_token_id, **text_config})
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in tokens.items()}
    config.image_token_id, config.boi_token_id, config.eoi_token_id = (ids["image_token"], ids["boi_token"],
                                                                       ids["eoi_token"])
    config.audio_token_id, config.boa_token_id, config.eoa_token_index = (ids["audio_token"], ids["boa_token"],
                                                                          ids["eoa_token"])
    config.video_token_id = tokenizer.convert_tokens_to_ids("<|video|>")  # the processor added it
    AutoModelForImageTextToText.from_config(config, seed=0).save_pretrained(path)
    processor.save_pretrained(str(path))
    return path
