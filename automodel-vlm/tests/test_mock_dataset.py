"""Upstream's synthetic VLM data set (``build_mock_vlm_dataset``, here MockVLMDataset): every argument acts, a bad
one is refused naming its key, and a CLI run trains on it (upstream_forms/mock_upstream.yaml)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from automodel import testing
from automodel.errors import AutomodelError, ConfigError
from automodel_vlm.datasets import MockVLMDataset, VLMCollator
from automodel_vlm.datasets.mock import DEFAULT_WORDS

FORM = Path(__file__).parent / "upstream_forms" / "mock_upstream.yaml"
ROUTE = ("finetune", "vlm")


def _pixels(sample: dict) -> np.ndarray:
    return np.stack([np.asarray(image) for image in sample["images"]])


def _response(sample: dict) -> str:
    return sample["messages"][1]["content"][0]["text"]


def test_samples_hold_the_asked_images_and_prompt_and_cycle_the_responses():
    data = MockVLMDataset(num_samples=5, num_images_per_sample=3, image_size=[40, 24], prompt="What is here?",
                          responses=["one", "two"])
    assert len(data) == 5
    sample = data[4]
    assert [(image.size, image.mode) for image in sample["images"]] == [((40, 24), "RGB")] * 3
    assert sample["messages"] == [
        {"role": "user", "content": [{"type": "image"}] * 3 + [{"type": "text", "text": "What is here?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "one"}]}]
    assert [_response(data[i]) for i in range(5)] == ["one", "two", "one", "two", "one"]


def test_a_seed_gives_the_same_samples_and_another_seed_others():
    same, again, other = (MockVLMDataset(num_samples=3, image_size=[16, 16], seed=seed) for seed in (7, 7, 8))
    for i in range(3):
        assert np.array_equal(_pixels(same[i]), _pixels(again[i])) and same[i]["messages"] == again[i]["messages"]
        assert np.array_equal(_pixels(same[i]), _pixels(same[i])), "reading a sample again gives the same images"
        assert not np.array_equal(_pixels(same[i]), _pixels(other[i])) and _response(same[i]) != _response(other[i])
    assert not np.array_equal(_pixels(same[0]), _pixels(same[1])), "each sample has images of its own"
    assert len(_response(same[0]).split()) == DEFAULT_WORDS, "without max_length: upstream's 256 words"


def test_max_length_fills_samples_with_generated_responses_and_cuts_given_ones(processor):
    collate = VLMCollator(processor)

    def tokens(sample: dict) -> int:
        return collate([sample])["input_ids"].shape[1]

    for max_length in (64, 120):
        data = MockVLMDataset(num_samples=4, image_size=[40, 24], max_length=max_length, processor=processor)
        lengths = [tokens(data[i]) for i in range(4)]
        assert all(max_length - 4 <= n <= max_length for n in lengths), (max_length, lengths)
    given = MockVLMDataset(num_samples=2, responses=["short", "long " * 100], max_length=64, processor=processor)
    assert _response(given[0]) == "short"
    assert _response(given[1]).startswith("long long") and len(_response(given[1])) < 500
    assert 60 <= tokens(given[1]) <= 64


def test_max_length_needs_room_for_a_response_and_the_processor(processor):
    with pytest.raises(AutomodelError, match=r"validation_dataset\.max_length: 20 tokens leave no room"):
        MockVLMDataset(num_samples=1, max_length=20, processor=processor, config_key="validation_dataset")
    with pytest.raises(AutomodelError, match=r"dataset\.max_length: sizing samples in tokens needs the processor"):
        MockVLMDataset(num_samples=1, max_length=64)
    with pytest.raises(AutomodelError, match=r"dataset\.image_size: must be \[width, height\]"):
        MockVLMDataset(image_size=(3, 0))


@pytest.mark.parametrize("key,value,needle", [
    ("image_size", "[0, 16]", "two whole numbers >= 1"),
    ("image_size", "[16]", "two whole numbers >= 1"),
    ("num_samples", "0", "whole number >= 1"),
    ("num_images_per_sample", "0", "whole number >= 1"),
    ("max_length", "0", "tokens per sample"),
    ("seed", "-1", "whole number >= 0"),
    ("responses", "[]", "non-empty list"),
    ("prompt", "[1]", "must be text"),
    ("pretokenize", "true", "not implemented"),
    ("processor", "x", "processor: section"),
    ("num_sample", "3", "does not accept"),
])
def test_bad_arguments_are_refused_at_validation_naming_the_key(key, value, needle):
    with pytest.raises(ConfigError) as info:
        testing.load_config(FORM, f"--dataset.{key}", value, route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert needle in found.get(f"dataset.{key}", ""), found


def test_cli_run_trains_on_mock_data_and_writes_a_checkpoint(tmp_path):
    result = testing.run_cli("finetune", "vlm", "-c", FORM, "--checkpoint.checkpoint_dir", tmp_path / "ckpt",
                             cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = testing.losses_by_step(tmp_path / "ckpt" / "training.jsonl")
    assert list(losses) == [2] and math.isfinite(losses[2]) and losses[2] > 0
    validation = testing.read_jsonl(tmp_path / "ckpt" / "validation.jsonl")
    assert [r["step"] for r in validation] == [2] and math.isfinite(validation[0]["val_loss"])
    assert testing.checkpoint_dirs(tmp_path / "ckpt") == ["epoch_0_step_2"]
    assert list((tmp_path / "ckpt" / "epoch_0_step_2" / "model").glob("*.safetensors"))
