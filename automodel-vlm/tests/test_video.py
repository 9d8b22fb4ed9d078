"""Video inputs for the Qwen3-VL family: the Pillow twin of transformers' Qwen3-VL video processor (its outputs
against a reference computed here from the formulas), clips read with Pillow (GIF, WebP, frame folders; other files
refused), and upstream's video form training a tiny Qwen3-VL and Qwen3.5 (fresh weights) on GIF clips."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence
from vlm_testing import TOKENIZER_DIR

from automodel import testing
from automodel.errors import AutomodelError, ConfigError

FORM = Path(__file__).parent / "upstream_forms" / "video_upstream.yaml"
ROUTE = ("finetune", "vlm")
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}
MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)  # Qwen3-VL's video mean and std (ImageNet's standard ones)


def moving_square(colour: str, way: str, count: int = 10, size: tuple[int, int] = (70, 50)) -> list[Image.Image]:
    """``count`` frames (width x height ``size``) of a white square crossing a coloured ground left or right."""
    frames = []
    for t in range(count):
        frame = Image.new("RGB", size, COLOURS[colour])
        x = 2 + 6 * t if way == "right" else size[0] - 10 - 6 * t
        frame.paste((255, 255, 255), (x, 20, x + 8, 28))
        frames.append(frame)
    return frames


def save_animation(path: Path, frames: list[Image.Image], milliseconds: int = 200) -> Path:
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=milliseconds, loop=0)
    return path


def write_clips(root: Path, count: int = 8) -> Path:
    """GIF clips (10 frames at 5 per second) with captions, one conversation per row of ``train.jsonl``."""
    rows = []
    for i in range(count):
        colour, way = list(COLOURS)[i % len(COLOURS)], ("right" if i % 2 else "left")
        name = save_animation(root / f"clip_{i}.gif", moving_square(colour, way)).name
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "video", "video": name}, {"type": "text", "text": "What moves?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"A square moves {way} on {colour}."}]}]})
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root / "train.jsonl"


def tiny_qwen_processor():
    """A real Qwen3VLProcessor built offline: the shipped tokenizer with Qwen's vision tokens, a chat template
    rendering images and videos as them, Pillow image and video processors (8-pixel patches, merged 2 x 2)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    from automodel_vlm.video_processors import Qwen3VLVideoProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>",
                                                                "<|vision_end|>", "<|video_pad|>"]})
    template = tokenizer.chat_template.replace(
        "{% if part['type'] == 'image' %}{{ '<image>' }}",
        "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}")
    assert "video_pad" in template
    images = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=8, merge_size=2,
                                      temporal_patch_size=2)
    videos = Qwen3VLVideoProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, cap_pixels_per_frame=False,
                                      size={"shortest_edge": 1024, "longest_edge": 64 * 64 * 8})
    return Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos,
                            chat_template=template)


def tiny_model_dir(root: Path, family: str) -> Path:
    """A tiny Qwen3-VL or Qwen3.5 (fresh weights) and its processor saved in one directory."""
    from automodel_vlm import AutoModelForImageTextToText

    processor = tiny_qwen_processor()
    tokenizer = processor.tokenizer
    ids = {"image_token_id": processor.image_token_id, "video_token_id": processor.video_token_id,
           "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
           "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>")}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 8,
              "out_hidden_size": 32, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "num_position_embeddings": 64}
    text = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "intermediate_size": 32, "vocab_size": len(tokenizer), "pad_token_id": 0}
    if family == "qwen3_vl":
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        config = {"model_type": "qwen3_vl", **ids,
                  "vision_config": {**vision, "model_type": "qwen3_vl_vision", "deepstack_visual_indexes": [0]},
                  "text_config": {**text, "model_type": "qwen3_vl_text", "rope_parameters": rope}}
    else:
        config = {"model_type": "qwen3_5", **ids, "vision_config": {**vision, "model_type": "qwen3_5_vision"},
                  "text_config": {**text, "model_type": "qwen3_5_text", "linear_num_key_heads": 2,
                                  "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                  "full_attention_interval": 2, "bos_token_id": None, "eos_token_id": None,
                                  "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5,
                                                      "mrope_section": [1, 1, 2], "mrope_interleaved": True}}}
    path = root / family
    AutoModelForImageTextToText.from_config(config, seed=0).save_pretrained(path)
    processor.save_pretrained(path)
    return path


# ---- the twin against the formulas ---------------------------------------------------------------------------------

def reference_patches(frames: list[Image.Image], size: tuple[int, int], patch: int = 8, merge: int = 2,
                      temporal: int = 2) -> np.ndarray:
    """Each frame resized (Pillow, bicubic) to ``size`` (width, height), scaled to [0, 1], normalised; then one row
    per patch: time, then merge blocks row by row, then the patches within a block; a row holds channel, frame in the
    temporal patch, pixel row, pixel column."""
    arrays = [(np.asarray(f.resize(size, Image.Resampling.BICUBIC), dtype=np.float32) / 255 - MEAN) / STD
              for f in frames]
    width, height = size
    rows = []
    for t in range(len(arrays) // temporal):
        for block_y in range(height // patch // merge):
            for block_x in range(width // patch // merge):
                for in_y in range(merge):
                    for in_x in range(merge):
                        y, x = (block_y * merge + in_y) * patch, (block_x * merge + in_x) * patch
                        rows.append([arrays[t * temporal + k][y + py, x + px, c] for c in range(3)
                                     for k in range(temporal) for py in range(patch) for px in range(patch)])
    return np.array(rows, dtype=np.float32)


def test_the_twin_samples_resizes_and_patchifies_as_the_formulas_say(tmp_path):
    processor = tiny_qwen_processor()
    clip_path = save_animation(tmp_path / "clip.gif", moving_square("blue", "right"))
    with Image.open(clip_path) as gif:
        frames = [frame.convert("RGB") for frame in ImageSequence.Iterator(gif)]
    from automodel_vlm.datasets.videos import read_clip

    clip = read_clip(clip_path)
    assert clip.frames.shape == (10, 50, 70, 3) and clip.fps == 5.0  # 200 ms a frame
    # fps 2 of a 2-second clip: int(10 / 5 * 2) = 4 frames (at least min_frames 4, at most 10), evenly spread:
    # linspace(0, 9, 4) = 0, 3, 6, 9
    chosen = [frames[i] for i in (0, 3, 6, 9)]
    # size: 50 x 70 rounds to 48 x 64 (16-pixel steps); 4 x 48 x 64 = 12288 pixels > 8 * 1024, so scaled by
    # beta = sqrt(4 * 50 * 70 / 8192) = 1.307: floor(50 / beta / 16) * 16 = 32 high, floor(70 / beta / 16) * 16 = 48
    # wide; grid: 2 temporal patches of 4 x 6 patches
    out = processor.video_processor(videos=[clip.frames], video_metadata=[clip.metadata], fps=2,
                                    size={"shortest_edge": 1024, "longest_edge": 8192}, return_tensors="pt")
    assert out["video_grid_thw"].tolist() == [[2, 4, 6]]
    expected = reference_patches(chosen, (48, 32))
    assert out["pixel_values_videos"].shape == (2 * 4 * 6, 3 * 2 * 8 * 8)
    np.testing.assert_allclose(out["pixel_values_videos"].numpy(), expected, atol=1e-5)

    # The processor's text: per temporal patch, its time (the mean of its two frames' times: (0 + 3) / 2 / 5 s,
    # (6 + 9) / 2 / 5 s) and 4 x 6 / 2**2 = 6 video tokens between the vision markers.
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False)
    batch = processor(text=[text], videos=[clip.frames], video_metadata=[clip.metadata], fps=2,
                      size={"shortest_edge": 1024, "longest_edge": 8192}, return_tensors="pt")
    decoded = processor.tokenizer.decode(batch["input_ids"][0])
    frame = "<|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"
    assert f"<0.3 seconds>{frame}<1.5 seconds>{frame}" in decoded
    assert (batch["input_ids"] == processor.video_token_id).sum() == 12
    assert (batch["mm_token_type_ids"] == 2).sum() == 12


def test_num_frames_max_frames_and_the_pixel_budget_act():
    from automodel_vlm.video_processors import Qwen3VLVideoProcessorPil

    clip = np.random.default_rng(0).integers(0, 255, (12, 44, 44, 3), dtype=np.uint8)
    meta = {"total_num_frames": 12, "fps": 4.0}

    def grid(**settings):
        vp = Qwen3VLVideoProcessorPil(patch_size=8, size={"shortest_edge": 256, "longest_edge": 44 * 44 * 12},
                                      **settings)
        return vp(videos=[clip], video_metadata=[dict(meta)], return_metadata=True)

    out = grid(fps=2)  # int(12 / 4 * 2) = 6 frames: 3 temporal patches, 44 x 44 rounds to 48 x 48
    assert out["video_grid_thw"].tolist() == [[3, 6, 6]]
    assert list(out["video_metadata"][0].frames_indices) == [0, 2, 4, 7, 9, 11]
    assert grid(fps=2, max_frames=4)["video_grid_thw"].tolist() == [[2, 6, 6]]
    assert grid(num_frames=3)["video_grid_thw"].tolist() == [[2, 6, 6]]  # 3 frames, the last repeated
    assert grid(num_frames=3)["video_metadata"][0].frames_indices.tolist() == [0, 6, 11]
    # 4 frames (min_frames) of 48 x 48 exceed 4 x 16 x 16: beta = sqrt(4 * 44 * 44 / 1024) = 2.75, 44 / 2.75 = 16
    small = Qwen3VLVideoProcessorPil(patch_size=8, size={"shortest_edge": 256, "longest_edge": 4 * 16 * 16})
    assert small(videos=[clip], video_metadata=[dict(meta)], fps=1)["video_grid_thw"].tolist() == [[2, 2, 2]]


def test_the_twin_saves_as_transformers_class_and_loads_back(tmp_path):
    from transformers import AutoTokenizer  # noqa: F401 - the processor's parts load with transformers

    from automodel_vlm.processor import load_processor
    from automodel_vlm.video_processors import Qwen3VLVideoProcessorPil

    tiny_qwen_processor().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["video_processor"]["video_processor_type"] == "Qwen3VLVideoProcessor"
    loaded = load_processor(str(tmp_path))
    assert type(loaded.video_processor) is Qwen3VLVideoProcessorPil and loaded.video_processor.patch_size == 8
    from automodel_vlm.family_processors import pillow_twin_note

    assert "Qwen3VLVideoProcessorPil" in pillow_twin_note(loaded)


# ---- clips in the conversation data --------------------------------------------------------------------------------

def test_gif_webp_and_frame_folders_read_alike_and_other_files_are_refused(tmp_path):
    from automodel_vlm.datasets import ImageTextChatDataset

    frames = moving_square("red", "left")
    save_animation(tmp_path / "a.gif", frames)
    save_animation(tmp_path / "a.webp", frames)
    (tmp_path / "frames").mkdir()
    for i, frame in enumerate(frames):
        frame.save(tmp_path / "frames" / f"{i:03d}.png")
    (tmp_path / "a.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")

    def rows(*parts: dict) -> Path:
        data = [{"messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]},
                              {"role": "assistant", "content": "left"}]} for part in parts]
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in data))
        return path

    data = ImageTextChatDataset(str(rows({"type": "video", "video": "a.gif"}, {"type": "video", "path": "a.webp"},
                                         {"type": "video", "video": "frames", "fps": 5})))
    clips = [data[i]["videos"][0] for i in range(3)]
    assert [clip.fps for clip in clips] == [5.0, 5.0, 5.0]
    assert all(clip.frames.shape == (10, 50, 70, 3) for clip in clips)
    np.testing.assert_array_equal(clips[2].frames[3], np.asarray(frames[3]))
    assert data[0]["messages"][0]["content"][0] == {"type": "video"}
    for part, needle in (({"type": "video", "video": "a.mp4"}, "no video decoder"),
                         ({"type": "video", "video": "frames"}, 'add "fps" to the video part'),
                         ({"type": "video", "video": "gone.gif"}, "not found"),
                         ({"type": "video", "video": "a.gif", "fps": 0}, "fps must be a positive number"),
                         ({"type": "video", "video": "a.gif", "frame_indices": [0, 2]}, "found frame_indices")):
        with pytest.raises(AutomodelError, match=needle):
            ImageTextChatDataset(str(rows(part)))


# ---- upstream's form, training -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_clips(tmp_path_factory.mktemp("clips"))


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_upstream_video_form_trains_the_vision_tower_on_gif_clips(tmp_path, clips, family, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the form's metric files go to checkpoint_dir's default, under the working directory
    model_dir = tiny_model_dir(tmp_path, family)
    seen, before = [], {}

    def record(run):
        tower = run.model.model.visual
        before.update({k: v.detach().clone() for k, v in tower.named_parameters()})
        compute = run.compute_loss

        def computed(model, batch):
            seen.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
            return compute(model, batch)

        run.compute_loss = computed

    recipe = testing.train_inprocess(FORM, "--model.pretrained_model_name_or_path", model_dir,
                                     "--processor.pretrained_model_name_or_path", model_dir,
                                     "--dataset.path_or_dataset_id", clips, route=ROUTE, before_run=record)
    video = recipe.processor.video_processor
    assert (video.fps, video.max_frames, video.size.longest_edge) == (2, 4, 8192)  # the section's settings
    assert len(seen) == 2
    batch = seen[0]
    # 10 frames at 5 per second, fps 2: 4 frames (max_frames 4), 2 temporal patches of each clip
    assert batch["video_grid_thw"][:, 0].tolist() == [2, 2, 2, 2]
    assert batch["pixel_values_videos"].shape[0] == int(batch["video_grid_thw"].prod(-1).sum())
    tokenizer = recipe.processor.tokenizer
    answers = [tokenizer.decode(row[row != -100]).strip() for row in batch["labels"]]
    assert answers == [f"A square moves {'right' if i % 2 else 'left'} on {c}.</s>"
                       for i, c in enumerate(list(COLOURS))]
    after = dict(recipe.model.model.visual.named_parameters())
    moved = [k for k, v in before.items() if not torch.equal(v, after[k].detach())]
    assert "patch_embed.proj.weight" in moved and len(moved) == len(before)
    # generation checks (eval_generation) hand the model the clips of the question too
    from automodel_vlm.datasets import ImageTextChatDataset

    index, prefix, _ = ImageTextChatDataset(str(clips)).qa_pairs[0]
    assert isinstance(recipe.answer(prefix, [], 2, ImageTextChatDataset(str(clips))[index]["videos"]), str)


def test_packed_rows_of_clips_give_the_loss_of_the_unpacked_batch(tmp_path, clips, monkeypatch):
    """Packed rows (each clip's rope positions from its own grid) and a padded batch of the same four clips: the
    first step's loss is the same, so the video tokens took the same positions and features."""
    monkeypatch.chdir(tmp_path)
    model_dir = tiny_model_dir(tmp_path, "qwen3_vl")
    losses = {}

    def recorder(name):
        def record(run):
            compute = run.compute_loss

            def computed(model, batch):
                loss = compute(model, batch)
                losses.setdefault(name, (loss.item() if hasattr(loss, "item") else loss, dict(batch)))
                return loss

            run.compute_loss = computed
        return record

    common = ("--model.pretrained_model_name_or_path", model_dir, "--processor.pretrained_model_name_or_path",
              model_dir, "--dataset.path_or_dataset_id", clips, "--step_scheduler.max_steps", 1)
    testing.train_inprocess(FORM, *common, route=ROUTE, before_run=recorder("padded"))
    testing.train_inprocess(FORM, *common, "--packed_sequence", "{pack_size: 512, pretokenize: true}",
                            "--dataset.limit_dataset_samples", 4, "--step_scheduler.global_batch_size", 1,
                            "--step_scheduler.local_batch_size", 1, route=ROUTE, before_run=recorder("packed"))
    packed_batch = losses["packed"][1]
    assert packed_batch["input_ids"].shape == (1, 512) and packed_batch["video_grid_thw"].shape == (4, 3)
    assert losses["packed"][0] == pytest.approx(losses["padded"][0], rel=1e-4)


def test_video_settings_that_cannot_act_are_refused_at_validation(clips):
    with pytest.raises(ConfigError) as info:
        testing.load_config(FORM, "--dataset.path_or_dataset_id", clips, "--processor.video_processor.max_frame", 3,
                            "--processor.video_processor.num_frames", 4, route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert "has no setting 'max_frame'" in found["processor.video_processor.max_frame"]
    assert "not both" in found["processor.video_processor.num_frames"]


def test_a_processor_without_videos_refuses_video_samples(tmp_path):
    from vlm_testing import tiny_processor

    from automodel_vlm.datasets import ImageTextChatDataset, VLMCollator

    data = ImageTextChatDataset(str(write_clips(tmp_path, count=1)))
    with pytest.raises(AutomodelError, match="takes none"):
        VLMCollator(tiny_processor())([data[0]])
    from vlm_testing import IMAGE_PROCESSOR_DIR

    from automodel_vlm.processor import build_processor
    from automodel_vlm.video_processors import PendingVideoProcessor

    with pytest.raises(AutomodelError, match="give it a pretrained_model_name_or_path"):
        build_processor(str(IMAGE_PROCESSOR_DIR), str(TOKENIZER_DIR),
                        video_processor=PendingVideoProcessor("Qwen3VLVideoProcessor", {"fps": 1}))


def test_the_budget_formula_matches_the_token_count():
    """get_num_of_video_patches (what the processor counts tokens by) agrees with what the twin produces."""
    from automodel_vlm.video_processors import Qwen3VLVideoProcessorPil

    vp = Qwen3VLVideoProcessorPil(patch_size=8, size={"shortest_edge": 256, "longest_edge": 4096})
    clip = np.zeros((5, 30, 70, 3), dtype=np.uint8)
    out = vp(videos=[clip], video_metadata=[{"total_num_frames": 5, "fps": 1.0}], do_sample_frames=False)
    assert vp.get_num_of_video_patches(5, 30, 70) == out["pixel_values_videos"].shape[0]
    assert out["video_grid_thw"][0][0] == math.ceil(5 / 2)


# ---- Qwen2-VL / Qwen2.5-VL -----------------------------------------------------------------------------------------

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def test_the_qwen2_vl_twin_and_a_tiny_qwen2_5_vl_learning_from_its_clips(tmp_path):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor

    from automodel_vlm import AutoModelForImageTextToText
    from automodel_vlm.datasets import ImageTextChatDataset, VLMCollator
    from automodel_vlm.datasets.videos import read_clip
    from automodel_vlm.video_processors import Qwen2VLVideoProcessorPil

    base = tiny_qwen_processor()
    videos = Qwen2VLVideoProcessorPil(patch_size=8, min_pixels=256, max_pixels=32 * 48, do_sample_frames=True,
                                      fps=2)
    assert (videos.size.shortest_edge, videos.size.longest_edge) == (256, 32 * 48)
    processor = Qwen2_5_VLProcessor(image_processor=base.image_processor, tokenizer=base.tokenizer,
                                    video_processor=videos, chat_template=base.chat_template)
    clip_path = save_animation(tmp_path / "clip.gif", moving_square("green", "left"))
    clip = read_clip(clip_path)
    # fps 2 of 10 frames at 5 per second: 4 frames (a multiple of 2), strided by 10 / 4: frames 0, 2, 5, 7.
    # Each frame alone: 50 x 70 rounds to 48 x 64 = 3072 pixels > 1536, so beta = sqrt(50 * 70 / 1536) = 1.51 and
    # floor(50 / beta / 16) * 16 = 32, floor(70 / beta / 16) * 16 = 32: a 2 x 4 x 4 grid, 8 video tokens.
    out = videos(videos=[clip.frames], video_metadata=[clip.metadata], return_metadata=True, return_tensors="pt")
    assert out["video_metadata"][0].frames_indices.tolist() == [0, 2, 5, 7]
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    with Image.open(clip_path) as gif:
        frames = [frame.convert("RGB") for frame in ImageSequence.Iterator(gif)]
    arrays = [(np.asarray(frames[i].resize((32, 32), Image.Resampling.BICUBIC), dtype=np.float32) / 255
               - CLIP_MEAN) / CLIP_STD for i in (0, 2, 5, 7)]
    first = [arrays[k][y, x, c] for c in range(3) for k in range(2) for y in range(8) for x in range(8)]
    np.testing.assert_allclose(out["pixel_values_videos"][0].numpy(), first, atol=1e-5)  # patch (0, 0) of t 0
    assert videos.get_num_of_video_patches(4, 50, 70) == out["pixel_values_videos"].shape[0] == 32
    assert videos.to_dict()["video_processor_type"] == "Qwen2VLVideoProcessor"

    data = ImageTextChatDataset(str(write_clips(tmp_path, count=2)))
    batch = VLMCollator(processor)([data[0], data[1]])
    assert batch["second_per_grid_ts"].tolist() == [1.0, 1.0]  # 2 frames per temporal patch at 2 sampled per second
    assert (batch["input_ids"] == processor.video_token_id).sum() == 2 * 8
    tokenizer = processor.tokenizer
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "intermediate_size": 32, "vocab_size": len(tokenizer),
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "num_heads": 2, "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "hidden_size": 16, "intermediate_size": 32, "out_hidden_size": 32, "window_size": 32,
                       "fullatt_block_indexes": [0]},
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"))
    model = AutoModelForImageTextToText.from_config(config, seed=0)
    model(**batch).loss.backward()
    grad = model.model.visual.patch_embed.proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0  # the loss reaches the vision tower through the clips
