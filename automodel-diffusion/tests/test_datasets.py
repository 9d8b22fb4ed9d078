"""Image-caption data: JSONL, image folders (imagefolder metadata or .txt sidecars), Pillow decoding, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusion_testing import SHAPES
from PIL import Image

from automodel.errors import AutomodelError
from automodel_diffusion.datasets import ImageCaptionDataset, collate_image_captions, image_to_tensor


def write_image(path, colour, size=(40, 24)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def test_the_shipped_shapes_jsonl():
    data = ImageCaptionDataset(str(SHAPES / "train.jsonl"), resolution=32)
    assert len(data) == 320
    sample = data[0]
    assert sample["pixel_values"].shape == (3, 32, 32) and sample["pixel_values"].dtype == torch.float32
    assert -1.0 <= float(sample["pixel_values"].min()) and float(sample["pixel_values"].max()) <= 1.0
    assert sample["caption"].endswith("background")
    batch = collate_image_captions([data[0], data[1]])
    assert batch["pixel_values"].shape == (2, 3, 32, 32) and len(batch["captions"]) == 2
    validation = ImageCaptionDataset(str(SHAPES), resolution=16, split="validation", limit_samples=5)
    assert len(validation) == 5 and validation[4]["pixel_values"].shape == (3, 16, 16)


def test_image_folder_with_metadata_jsonl(tmp_path):
    write_image(tmp_path / "a.png", (255, 0, 0))
    write_image(tmp_path / "sub" / "b.jpg", (0, 0, 255))
    rows = [{"file_name": "a.png", "caption": "red"}, {"file_name": "sub/b.jpg", "caption": "blue"}]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = ImageCaptionDataset(str(tmp_path), resolution=8)
    assert [data[i]["caption"] for i in range(2)] == ["red", "blue"]
    red = data[0]["pixel_values"]
    assert torch.allclose(red[0], torch.ones(8, 8)) and torch.allclose(red[2], -torch.ones(8, 8))


def test_image_folder_with_caption_files(tmp_path):
    write_image(tmp_path / "x.png", (0, 255, 0))
    (tmp_path / "x.txt").write_text("green square\n")
    data = ImageCaptionDataset(str(tmp_path), resolution=8)
    assert len(data) == 1 and data[0]["caption"] == "green square"
    write_image(tmp_path / "y.png", (0, 0, 0))
    with pytest.raises(AutomodelError, match="no caption file"):
        ImageCaptionDataset(str(tmp_path), resolution=8)


def test_resize_and_center_crop():
    image = Image.new("RGB", (60, 20), (0, 0, 0))
    image.paste((255, 255, 255), (20, 0, 40, 20))  # a white middle third
    pixels = image_to_tensor(image, 10)
    assert pixels.shape == (3, 10, 10)
    assert float(pixels.mean()) > 0.9, "the centre crop keeps the white middle"
    assert np.isclose(float(image_to_tensor(image, 10, center_crop=False).mean()), -1.0, atol=0.1)


def test_bad_sources_are_reported(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"image": "missing.png", "caption": "c"}) + "\n")
    with pytest.raises(AutomodelError, match="does not exist"):
        ImageCaptionDataset(str(tmp_path / "rows.jsonl"), resolution=8)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"picture": "a.png"}) + "\n")
    with pytest.raises(AutomodelError, match="needs 'image'"):
        ImageCaptionDataset(str(tmp_path / "rows.jsonl"), resolution=8)


def test_a_jsonl_line_that_is_not_json_is_named_with_its_config_key_file_and_line(tmp_path):
    from automodel.errors import AutomodelError
    from automodel_diffusion.datasets import jsonl_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n', encoding="utf-8")
    rows = jsonl_rows(path, "dataset.path")
    assert next(rows) == (1, {"a": 1})  # the blank line is skipped
    with pytest.raises(AutomodelError, match=rf"^dataset.path: {path}:3 is not JSON"):
        next(rows)
