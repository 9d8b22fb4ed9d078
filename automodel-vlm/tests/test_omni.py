"""The omni families on image and text data (automodel_vlm.omni, datasets/omni.py): upstream's Qwen3-Omni and
Nemotron Omni forms train two steps on tiny models of transformers' own classes (fresh weights) with a processor
built here (the shipped tokenizer with the family's tokens, a Pillow image processor); the loss is on the assistant
tokens only; the saved model loads with transformers' class and gives the same logits; audio and video rows, the
collators' video keys and the omni families not trained here are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vlm_testing import TOKENIZER_DIR, conversation

from automodel import testing
from automodel.errors import AutomodelError, ConfigError

FORMS = Path(__file__).parent / "upstream_forms"
ROUTE = ("finetune", "vlm")
QWEN_TOKENS = {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
               "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
               "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
NEMOTRON_TOKENS = ["<img>", "</img>", "<video>", "<so_embedding>", "<so_start>", "<so_end>"]


def _qwen3_omni() -> tuple[object, object]:
    """A tiny whole Qwen3-Omni's config (no talker) and its images-only processor."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3OmniMoeConfig, WhisperFeatureExtractor

    from automodel_vlm.omni import omni_processor_class

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), extra_special_tokens=QWEN_TOKENS)
    template = tokenizer.chat_template.replace("'<image>'", "'<|vision_start|><|image_pad|><|vision_end|>'")
    images = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=32 * 32, patch_size=8, merge_size=2,
                                      temporal_patch_size=2)
    processor = omni_processor_class("Qwen3OmniMoeProcessor")(images, WhisperFeatureExtractor(), tokenizer,
                                                               chat_template=template)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3OmniMoeConfig(enable_audio_output=False, thinker_config={
        "text_config": {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 64,
                        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                        "num_key_value_heads": 1, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                        "rope_scaling": {"rope_type": "default", "mrope_section": [4, 6, 6], "interleaved": True},
                        "pad_token_id": tokenizer.pad_token_id},
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
                          "deepstack_visual_indexes": [0]},
        "audio_config": {"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                         "output_dim": 64, "num_mel_bins": 128, "downsample_hidden_size": 16},
        "image_token_id": processor.image_token_id, "video_token_id": processor.video_token_id,
        "audio_token_id": processor.audio_token_id, "vision_start_token_id": ids("<|vision_start|>"),
        "audio_start_token_id": ids("<|audio_start|>")})
    return processor, config


def _nemotron_omni() -> tuple[object, object]:
    """A tiny Nemotron-H Omni's config (one Mamba and one attention layer, RADIO 1x32) and its images-only
    processor."""
    from transformers import AutoTokenizer, NemotronH_Omni_Reasoning_V3_Config, ParakeetFeatureExtractor

    from automodel_vlm.image_processors import NemotronH_Omni_Reasoning_V3ImageProcessorPil
    from automodel_vlm.omni import omni_processor_class

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tokenizer.add_special_tokens({"additional_special_tokens": NEMOTRON_TOKENS})
    images = NemotronH_Omni_Reasoning_V3ImageProcessorPil(patch_size=8, min_num_patches=4, max_num_patches=16,
                                                          max_model_len=64)
    processor = omni_processor_class("NemotronH_Omni_Reasoning_V3Processor")(
        images, ParakeetFeatureExtractor(), tokenizer, chat_template=tokenizer.chat_template)
    config = NemotronH_Omni_Reasoning_V3_Config(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "layers_block_type": ["mamba", "attention"],
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128,
                     "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
                     "chunk_size": 16, "use_mamba_kernels": False, "pad_token_id": tokenizer.pad_token_id},
        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 8,
                       "image_size": 32, "max_img_size": 64, "num_cls_tokens": 1, "num_registers": 1,
                       "video_temporal_patch_size": 2},
        vision_hidden_size=32, projector_hidden_size=64, image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id, audio_token_id=processor.audio_token_id)
    return processor, config


def _save(family, folder: Path) -> object:
    """The family's tiny model (fresh weights, seeded) and processor saved in ``folder``; the processor."""
    from transformers import AutoModelForImageTextToText, AutoModelForMultimodalLM

    processor, config = family()
    torch.manual_seed(0)
    auto = AutoModelForMultimodalLM if config.model_type == "qwen3_omni_moe" else AutoModelForImageTextToText
    auto.from_config(config).save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    return processor


# family -> (tiny builder, upstream form, transformers' class of the trained model, our collator)
FAMILIES = {
    "qwen3_omni": (_qwen3_omni, "qwen3_omni_upstream.yaml", "Qwen3OmniMoeThinkerForConditionalGeneration",
                   "Qwen3OmniCollator"),
    "nemotron_omni": (_nemotron_omni, "nemotron_omni_upstream.yaml", "NemotronH_Omni_Reasoning_V3",
                      "NemotronOmniCollator"),
}


def _overrides(folder: Path, form: str) -> list:
    paths = ["--model.pretrained_model_name_or_path", folder]
    if form.startswith("nemotron"):
        paths += ["--processor.pretrained_model_name_or_path", folder]
    return paths


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_upstreams_omni_form_trains_on_images_and_the_saved_model_loads_with_transformers(family, tmp_path):
    import transformers

    build, form, model_class, collator_class = FAMILIES[family]
    processor = _save(build, tmp_path / "model")
    recipe = testing.train_inprocess(FORMS / form, *_overrides(tmp_path / "model", form),
                                     "--checkpoint.checkpoint_dir", tmp_path / "ckpt",
                                     "--step_scheduler.log_interval", 1, route=ROUTE)
    assert type(recipe.model).__name__ == model_class
    losses = [r["loss"] for r in testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))

    # the recipe's collator (upstream's collate name, ours) labels the assistant's answer and its end of turn only
    collator = recipe.dataloader.collate_fn.fn  # inside the core's CheckedCollate
    assert type(collator).__name__ == collator_class
    sample = recipe.train_dataset[0]
    batch = collator([sample])
    labelled = batch["labels"][0][batch["labels"][0] != -100].tolist()
    answer = sample["messages"][-1]["content"][0]["text"]
    assert processor.tokenizer.decode(labelled).strip() == answer + processor.tokenizer.eos_token
    assert (batch["input_ids"] == processor.image_token_id).sum() > 1  # the image reached the model's input

    # transformers' own class loads the saved model: the same logits as the trained one
    saved = sorted((tmp_path / "ckpt").glob("**/model/config.json"))[-1].parent
    loaded = getattr(transformers, model_class).from_pretrained(str(saved)).eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    recipe.model.eval()
    with torch.no_grad():
        expected, got = recipe.model(**inputs).logits, loaded(**inputs).logits
    assert torch.allclose(expected, got, atol=1e-5)


def _picture():
    from PIL import Image

    return Image.new("RGB", (32, 32), (128, 0, 128))


@pytest.mark.parametrize("part", [{"type": "audio", "audio": "a.wav"}, {"type": "video", "video": "v.mp4"}])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rows_with_audio_or_video_are_refused_when_a_batch_is_made(family, part, tmp_path):
    from automodel_vlm.datasets.omni import NemotronOmniCollator, Qwen3OmniCollator

    processor, _ = FAMILIES[family][0]()
    collator = {"Qwen3OmniCollator": Qwen3OmniCollator, "NemotronOmniCollator": NemotronOmniCollator}[
        FAMILIES[family][3]](processor)
    messages = conversation("What is heard?", "rain")
    messages[0]["content"].append(part)
    with pytest.raises(AutomodelError, match=f"sample 1 of the batch carries {part['type']}.*no audio or video "
                                             "decoder is installed"):
        collator([{"messages": messages, "images": [_picture()]}])


def test_the_collators_video_keys_are_refused_at_validation(tmp_path):
    form = FORMS / "nemotron_omni_upstream.yaml"
    with pytest.raises(ConfigError) as info:
        testing.load_config(form, "--dataloader.collate_fn.max_video_frames", "8", route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert "no video is read here" in found["dataloader.collate_fn.max_video_frames"], found
    form = FORMS / "qwen3_omni_upstream.yaml"
    with pytest.raises(ConfigError) as info:
        testing.load_config(form, "--dataloader.collate_fn.use_audio_in_video", "true", route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert "sound track" in found["dataloader.collate_fn.use_audio_in_video"], found


def test_other_multimodal_lm_families_are_refused_with_the_reason(tmp_path):
    from transformers import Qwen2AudioConfig

    from automodel_vlm.omni import AutoModelForMultimodalLM

    Qwen2AudioConfig().save_pretrained(str(tmp_path))
    with pytest.raises(AutomodelError, match="model_type 'qwen2_audio' is not supported.*audio \\(speech\\) model"):
        AutoModelForMultimodalLM.from_pretrained(str(tmp_path))


def test_without_torchvision_a_saved_omni_processor_loads_images_only(tmp_path):
    from automodel_vlm.processor import load_processor

    for family in FAMILIES.values():
        processor, _ = family[0]()
        processor.save_pretrained(str(tmp_path / family[1]))
        loaded = load_processor(str(tmp_path / family[1]))
        assert type(loaded).__name__ == type(processor).__name__
        assert loaded.image_processor.to_dict() == processor.image_processor.to_dict()
        with pytest.raises(ValueError, match="takes no videos"):
            loaded(text=["x"], videos=[[_picture()]])


def _transformers_nemotron_helpers() -> dict:
    """transformers' own grid rule and patch layout of Nemotron-H Omni's image processor, read from its source (the
    module imports torchvision, which is not installed here; the two functions need only math and torch)."""
    import ast
    import math

    import transformers

    source = Path(transformers.__file__).parent / "models" / "nemotron_h_omni" / "image_processing_nemotron_h_omni.py"
    wanted = [node for node in ast.parse(source.read_text()).body if isinstance(node, ast.FunctionDef)
              and node.name in ("get_patch_grid_size", "convert_image_to_patches")]
    namespace: dict = {"math": math, "torch": torch}
    exec(compile(ast.Module(wanted, []), str(source), "exec"), namespace)  # noqa: S102 - transformers' own source
    return namespace


def test_our_nemotron_omni_pillow_twin_gives_transformers_grids_and_patches():
    import numpy as np

    from automodel_vlm.image_processors import NemotronH_Omni_Reasoning_V3ImageProcessorPil, nemotron_omni_grid

    theirs = _transformers_nemotron_helpers()

    def grid(rule, *args):
        try:
            return rule(*args)
        except ZeroDivisionError:  # a sliver of an image: both rules divide by an empty grid
            return "empty"

    for settings in [(8, 2, 4, 16), (16, 2, 1024, 13312), (14, 2, 16, 64), (8, 3, 9, 90)]:
        for height in range(1, 200, 3):
            for width in range(1, 200, 7):
                args = (height, width, *settings)
                assert grid(nemotron_omni_grid, *args) == grid(theirs["get_patch_grid_size"], *args), args
    # an image already on its grid is not resized: the same pixel values as transformers' rescale, normalise, patch
    pixels = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    twin = NemotronH_Omni_Reasoning_V3ImageProcessorPil(patch_size=8, min_num_patches=4, max_num_patches=64)
    got = twin(pixels, return_tensors="pt")
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (twin.image_mean, twin.image_std))
    image = (torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 255 - mean) / std
    assert got["image_grid_hw"].tolist() == [[4, 6]]
    assert torch.allclose(got["pixel_values"], theirs["convert_image_to_patches"](image, 8)[0], atol=1e-5)
