"""Our Pillow twins of the Inkling, MiniMax-M3-VL and Step3.7 image processors (image_processors.py) and of
transformers' PixtralProcessor (family_processors.py, with transformers' Pillow Pixtral image processor), inside the
families' processors: on real PIL images of a few sizes they give the layouts, grids and image-token counts the
families' models expect, and pixel values equal to a reference written here from the families' formulas (Pillow
resize, then ``(x / 255 - mean) / std``, then the family's patching) to 1e-5 absolute."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from test_family_processors import INKLING_TOKENS, MINIMAX_TOKENS, STEP3P7_TOKENS, _family_tokenizer

from automodel_vlm.family_processors import images_only_minimax_class
from automodel_vlm.image_processors import (
    InklingImageProcessorPil,
    MiniMaxM3VLImageProcessorPil,
    Step3p7ImageProcessorPil,
)

MEAN = np.array([0.48145466, 0.4578275, 0.40821073])  # OpenAI CLIP's, the three families' defaults
STD = np.array([0.26862954, 0.26130258, 0.27577711])
TOLERANCE = 1e-5
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """A real RGB picture: a gradient with noise (every pixel differs, so a misplaced patch shows)."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / max(width - 1, 1), ys * 255 / max(height - 1, 1), (xs + ys) % 256], axis=-1)
    return Image.fromarray(np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8))


def _normalised(picture: Image.Image) -> np.ndarray:
    """HWC float64 ``(x / 255 - mean) / std``."""
    return (np.asarray(picture, dtype=np.float64) / 255.0 - MEAN) / STD


def _count(ids: torch.Tensor, tokenizer, token: str) -> int:
    return int((ids == tokenizer.convert_tokens_to_ids(token)).sum())


# ---- Inkling: 40-pixel tiles (rows: ceil(h / 40), columns: w // 40 + 1), one image token each ----------------------

@pytest.mark.parametrize(("width", "height", "frac", "tiles"), [
    (90, 50, None, 2 * 3),    # rows ceil(50/40) = 2, columns 90 // 40 + 1 = 3
    (80, 40, None, 1 * 3),    # a width 40 divides still gets one more (empty) column
    (33, 17, None, 1 * 1),
    (90, 50, 0.5, 1 * 2),     # rescaled first to 45 x 25: 1 row, 45 // 40 + 1 = 2 columns
])
def test_inkling_tiles_count_and_pixels(width, height, frac, tiles):
    tokenizer, template = _family_tokenizer(INKLING_TOKENS, "<|content_image|><|unused_200054|>")
    from transformers import InklingFeatureExtractor, InklingProcessor

    images = InklingImageProcessorPil(rescale_image_frac=frac)
    processor = InklingProcessor(InklingFeatureExtractor(), images, tokenizer, chat_template=template)
    picture = _picture(width, height)
    out = processor(images=[picture], text=["<|unused_200054|> what is it?"], return_tensors="pt")
    assert out["pixel_values"].shape == (tiles, 2, 40, 40, 3)
    assert _count(out["input_ids"], tokenizer, "<|unused_200054|>") == tiles
    if frac is not None:  # the long edge times frac, half-up rounded, Lanczos
        size = (math.floor(width * frac + 0.5), math.floor(height * frac + 0.5))
        picture = picture.resize(size, Image.Resampling.LANCZOS)
    pixels = np.asarray(picture, dtype=np.float64)
    expected = []
    for top in range(0, math.ceil(pixels.shape[0] / 40) * 40, 40):
        for left in range(0, (pixels.shape[1] // 40 + 1) * 40, 40):
            tile = np.full((40, 40, 3), -1.0)  # padded with -1 before rescaling, as the model was trained
            cut = pixels[top:top + 40, left:left + 40]
            tile[:cut.shape[0], :cut.shape[1]] = cut
            expected.append((tile / 255.0 - MEAN) / STD)
    assert len(expected) == tiles
    got = out["pixel_values"].numpy()
    for copy in (0, 1):
        np.testing.assert_allclose(got[:, copy], np.stack(expected), atol=TOLERANCE, rtol=0)


# ---- MiniMax-M3-VL: smart resize to multiples of patch * merge, patches flattened per merge window ------------------

@pytest.mark.parametrize(("width", "height", "grid"), [
    (64, 64, (4, 4)),      # already multiples of 16: 4 x 4 blocks of 16 pixels
    (100, 60, (4, 6)),     # rounded to multiples: 60 -> 64, 100 -> 96 (6144 pixels, within 1024..6400)
    (300, 200, (4, 6)),    # 192 x 304 is over 6400: both sides / sqrt(60000 / 6400), floored to 64 x 96
    (20, 12, (2, 3)),      # 16 x 16 is under 1024: both sides * sqrt(1024 / 240), ceiled to 32 x 48
])
def test_minimax_grid_tokens_and_pixels(width, height, grid):
    """Patch 8, merge 2 (factor 16), 2 temporal copies, 32 x 32 to 80 x 80 pixels."""
    tokenizer, template = _family_tokenizer(MINIMAX_TOKENS, "]<]image[>[")
    images = MiniMaxM3VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                                          max_pixels=80 * 80)
    processor = images_only_minimax_class()(images, tokenizer, chat_template=template)
    picture = _picture(width, height, seed=1)
    out = processor(images=[picture], text=["]<]image[>[ describe"], return_tensors="pt")
    rows, columns = grid  # in 16-pixel blocks
    gh, gw = rows * 2, columns * 2  # in 8-pixel patches
    assert out["image_grid_thw"].tolist() == [[1, gh, gw]]
    assert out["pixel_values"].shape == (gh * gw, 3 * 2 * 8 * 8)
    assert _count(out["input_ids"], tokenizer, "]<]image[>[") == gh * gw // 4
    assert _count(out["input_ids"], tokenizer, "]<]start of image[>[") == 1
    values = _normalised(picture.resize((gw * 8, gh * 8), Image.Resampling.BICUBIC)).transpose(2, 0, 1)  # CHW
    expected = []
    for block_row in range(rows):
        for block_column in range(columns):
            for inner_row in range(2):
                for inner_column in range(2):
                    top, left = (block_row * 2 + inner_row) * 8, (block_column * 2 + inner_column) * 8
                    patch = values[:, top:top + 8, left:left + 8]  # (C, 8, 8)
                    expected.append(np.stack([patch, patch], axis=1).reshape(-1))  # (C, T, 8, 8) flattened
    np.testing.assert_allclose(out["pixel_values"].numpy(), np.stack(expected), atol=TOLERANCE, rtol=0)


def test_minimax_checkpoint_size_quirk_saved_names_and_no_videos(tmp_path):
    """The official checkpoint's size [672, 672] stands for the class default; saved, the twin names transformers'
    torchvision class, and the images-only processor transformers' processor class; it refuses videos (transformers'
    class would drop them and leave their tokens)."""
    assert MiniMaxM3VLImageProcessorPil(size=[672, 672]).size["longest_edge"] == 451584
    assert MiniMaxM3VLImageProcessorPil().to_dict()["image_processor_type"] == "MiniMaxM3VLImageProcessor"
    tokenizer, template = _family_tokenizer(MINIMAX_TOKENS, "]<]image[>[")
    images_only_minimax_class()(MiniMaxM3VLImageProcessorPil(), tokenizer, chat_template=template).save_pretrained(
        str(tmp_path))
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["processor_class"] == "MiniMaxM3VLProcessor"
    assert saved["image_processor"]["image_processor_type"] == "MiniMaxM3VLImageProcessor"
    processor = images_only_minimax_class()(MiniMaxM3VLImageProcessorPil(), tokenizer, chat_template=template)
    with pytest.raises(ValueError, match="takes no videos"):
        processor(text=["]<]video[>["], videos=[np.zeros((2, 32, 32, 3), dtype=np.uint8)])


# ---- Step3.7: a global view plus sliding-window local crops ------------------------------------------------------

# size 112, crops 56: 4 image tokens per global view, 1 per crop (the vision tower's stride is 14 * 4 = 56)
STEP_CASES = {
    "fits": (100, 90, None),                                       # long side <= 112, not elongated: no crops
    # elongated (100 / 40 > 1.5) yet fitting: window = short side 40; 100 -> 40 * (2 + (20 > 8)) = 120, 40 -> 40
    "elongated": (100, 40, {"window": 40, "crop_wh": (120, 40), "grid": (3, 1)}),
    # over 112: window 56; 300 -> 56 * (5 + (20 > 11.2)) = 336, 200 -> 56 * (3 + (32 > 11.2)) = 224
    "large": (300, 200, {"window": 56, "crop_wh": (336, 224), "grid": (6, 4)}),
    # min side 20 < 32 and aspect 10 > 4: zero-padded to 200 x 200 first; 200 -> 56 * (3 + (32 > 11.2)) = 224
    "extreme": (200, 20, {"window": 56, "crop_wh": (224, 224), "grid": (4, 4), "square": 200}),
}


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_step3p7_views_tokens_and_pixels(case):
    from transformers import Step3p7Processor

    width, height, plan = STEP_CASES[case]
    tokenizer, template = _family_tokenizer(STEP3P7_TOKENS, "<im_patch>")
    processor = Step3p7Processor(Step3p7ImageProcessorPil(size={"height": 112, "width": 112}, patch_size=56),
                                 tokenizer, chat_template=template)
    picture = _picture(width, height, seed=2)
    out = processor(images=[picture], text=["<im_patch> what is it?"], return_tensors="pt")
    across, down = plan["grid"] if plan else (0, 0)
    crops = across * down
    assert out["pixel_values"].shape == (1, 3, 112, 112)
    assert out["num_local_patches"].tolist() == [crops]
    assert processor.image_processor.get_number_of_image_patches(height, width) == crops
    assert _count(out["input_ids"], tokenizer, "<im_patch>") == 4 + crops
    assert _count(out["input_ids"], tokenizer, "<patch_start>") == crops
    assert _count(out["input_ids"], tokenizer, "<patch_newline>") == max(down - 1, 0)
    bilinear = Image.Resampling.BILINEAR
    source = picture
    if plan and "square" in plan:  # the picture at the top left of a black square
        source = Image.new("RGB", (plan["square"], plan["square"]))
        source.paste(picture, (0, 0))
    global_view = source.resize(source.size, bilinear).resize((112, 112), bilinear)
    np.testing.assert_allclose(out["pixel_values"][0].numpy(), _normalised(global_view).transpose(2, 0, 1),
                               atol=TOLERANCE, rtol=0)
    if not plan:
        assert "pixel_values_local" not in out
        return
    window = plan["window"]
    for_crops = source.resize(plan["crop_wh"], bilinear)
    expected = [_normalised(for_crops.crop((c * window, r * window, (c + 1) * window, (r + 1) * window))
                            .resize((56, 56), bilinear)).transpose(2, 0, 1)
                for r in range(down) for c in range(across)]
    np.testing.assert_allclose(out["pixel_values_local"].numpy(), np.stack(expected), atol=TOLERANCE, rtol=0)


@pytest.mark.skipif(not HAS_TORCHVISION, reason="compares with transformers' torchvision classes")
@pytest.mark.parametrize("family", ["inkling", "minimax", "step3p7"])
def test_twins_match_transformers_torchvision_classes(family):
    """Where torchvision is installed: the same keys, shapes and counts, pixel values within resampling noise."""
    import transformers

    twin, settings = {"inkling": (InklingImageProcessorPil, {}),
                      "minimax": (MiniMaxM3VLImageProcessorPil, {"min_pixels": 32 * 32, "max_pixels": 80 * 80}),
                      "step3p7": (Step3p7ImageProcessorPil, {"size": {"height": 112, "width": 112},
                                                             "patch_size": 56})}[family]
    theirs = getattr(transformers, twin.__name__.removesuffix("Pil"))(**settings)
    pictures = [_picture(300, 200, 3), _picture(90, 50, 4)]
    ours, reference = twin(**settings)(pictures, return_tensors="pt"), theirs(pictures, return_tensors="pt")
    assert set(ours) == set(reference)
    for key, value in reference.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert ours[key].shape == value.shape, key
            assert (ours[key] - value).abs().mean() < 0.05, key
        else:
            assert (ours[key].tolist() if isinstance(ours[key], torch.Tensor) else ours[key]) == (
                value.tolist() if isinstance(value, torch.Tensor) else value), key


# ---- Pixtral (Mistral 3): longest edge within size, both sides up to multiples of the merged patch -----------------

@pytest.mark.parametrize(("sizes", "resized"), [
    ([(7, 5)], [(8, 8)]),                  # within 32: each side up to a multiple of 8
    ([(50, 21)], [(16, 32)]),              # scaled by 32 / 50 (floored: 13 x 32), then 13 -> 16
    ([(33, 9)], [(8, 32)]),                # scaled by 32 / 33: 8 x 32 (9 * 32 / 33 = 8.7, floored)
    ([(50, 21), (17, 40)], [(16, 32), (32, 16)]),  # 17 x 40: by 32 / 40 to 32 x 13 -> 32 x 16; both padded to 32 x 32
])
def test_pixtral_sizes_tokens_and_pixels(sizes, resized):
    """(width, height) pictures through the Pixtral processor (4-pixel patches merged 2 x 2, longest edge 32):
    ``image_sizes`` each resized (height, width), ``pixel_values`` every image zero-padded to the largest, and per
    image ``height / 8`` rows of ``width / 8`` ``[IMG]`` each closed by ``[IMG_BREAK]``, the last by ``[IMG_END]``."""
    from test_family_processors import tiny_pixtral_processor

    processor = tiny_pixtral_processor(longest_edge=32)
    tokenizer = processor.tokenizer
    pictures = [_picture(width, height, seed=i) for i, (width, height) in enumerate(sizes)]
    out = processor(images=pictures, text=["[IMG]" * len(sizes) + " what is it?"], return_tensors="pt")
    assert out["image_sizes"].tolist() == [list(r) for r in resized]
    tall, wide = max(h for h, _ in resized), max(w for _, w in resized)
    assert out["pixel_values"].shape == (len(sizes), 3, tall, wide)
    expected_ids = []
    for height, width in resized:
        row = ["[IMG]"] * (width // 8) + ["[IMG_BREAK]"]
        expected_ids += (row * (height // 8))[:-1] + ["[IMG_END]"]
    ids = out["input_ids"][0].tolist()
    image_ids = tokenizer.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    assert tokenizer.convert_ids_to_tokens([i for i in ids if i in image_ids]) == expected_ids
    assert _count(out["input_ids"], tokenizer, "[IMG]") == sum(h * w // 64 for h, w in resized)
    for picture, (height, width), got in zip(pictures, resized, out["pixel_values"].numpy(), strict=True):
        values = _normalised(picture.resize((width, height), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
        np.testing.assert_allclose(got[:, :height, :width], values, atol=TOLERANCE, rtol=0)
        assert not got[:, height:].any() and not got[:, :, width:].any()
