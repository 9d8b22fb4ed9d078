"""Kimi K2.5 with transformers' own classes: upstream's Kimi-K2.5 form (upstream_forms/kimi_k25_upstream.yaml),
our Pillow twin of its image processor, the processor loaded for a checkpoint that names the hub's remote-code one,
and upstream's ``kimi_k25_vl_collate_fn`` (automodel_vlm.datasets.kimi_k25.KimiK25Collator).

The tiny Kimi K2.5 is built here: fresh weights of a small DeepSeek-V3 MoE text model and a one-layer vision tower,
the shipped tokenizer with Kimi's tokens and a Kimi-form chat template written for this test."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_testing import SHAPES, TOKENIZER_DIR

from automodel import testing
from automodel.errors import AutomodelError, ConfigError
from automodel_vlm.datasets.collate import IGNORE_INDEX, VLMCollator
from automodel_vlm.datasets.kimi_k25 import KimiK25Collator
from automodel_vlm.family_processors import images_only_kimi_k25_class
from automodel_vlm.image_processors import Kimi_K25ImageProcessorPil, kimi_k25_sizes
from automodel_vlm.processor import is_kimi_k25_checkpoint, load_processor

FORM = Path(__file__).parent / "upstream_forms" / "kimi_k25_upstream.yaml"
ROUTE = ("finetune", "vlm")
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
KIMI_TOKENS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>", "<|media_begin|>",
               "<|media_content|>", "<|media_pad|>", "<|media_end|>", "<|kimi_k25_video_placeholder|>"]
# Kimi's turn layout (role markers, <|im_middle|>, <|im_end|>; an image as media_begin .. media_pad .. media_end)
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_user|>user<|im_middle|>"
    "{% elif m['role'] == 'assistant' %}<|im_assistant|>assistant<|im_middle|>"
    "{% else %}<|im_system|>system<|im_middle|>{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")
# patch 4, merge 2, at most 8 patches a side: a 32 x 32 shapes picture gives 8 x 8 patches, 16 image tokens
IMAGES = {"patch_size": 4, "merge_size": 2, "size": {"max_height": 8, "max_width": 8}}
MEAN = STD = np.array([0.5, 0.5, 0.5])  # ImageNet "standard", Kimi K2.5's
TOLERANCE = 1e-5


def tiny_processor():
    """transformers' Kimi_K25Processor (images-only, with our Pillow twin, without torchvision)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tokenizer.add_special_tokens({"additional_special_tokens": KIMI_TOKENS})
    if HAS_TORCHVISION:
        from transformers import Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

        return Kimi_K25Processor(Kimi_K25ImageProcessor(**IMAGES), tokenizer, Kimi_K25VideoProcessor(),
                                 chat_template=TEMPLATE)
    return images_only_kimi_k25_class()(Kimi_K25ImageProcessorPil(**IMAGES), tokenizer, chat_template=TEMPLATE)


def tiny_config(processor):
    from transformers import Kimi_K25Config

    tokenizer = processor.tokenizer
    text = {"model_type": "deepseek_v3", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "n_group": 1, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 256,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, "eos_token_id": None}
    vision = {"patch_size": 4, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 1, "num_attention_heads": 2,
              "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                          image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
                          vision_start_token_id=tokenizer.convert_tokens_to_ids("<|media_begin|>"),
                          vision_end_token_id=tokenizer.convert_tokens_to_ids("<|media_end|>"))


def _shapes(limit: int) -> list[dict]:
    return [json.loads(line) for line in (SHAPES / "train.jsonl").read_text().splitlines()[:limit]]


def _samples(limit: int = 2) -> list[dict]:
    return [{"messages": row["messages"], "images": [Image.open(SHAPES / row["image"]).convert("RGB")]}
            for row in _shapes(limit)]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    """A tiny Kimi K2.5 checkpoint (model and processor, as transformers saves them) and MedPix-form rows of the
    shipped shapes pictures."""
    from transformers import Kimi_K25ForConditionalGeneration

    root = tmp_path_factory.mktemp("kimi_k25")
    processor = tiny_processor()
    torch.manual_seed(0)
    Kimi_K25ForConditionalGeneration(tiny_config(processor)).save_pretrained(root / "model")
    processor.save_pretrained(root / "model")
    rows = [{"image_id": str(SHAPES / row["image"]), "question": row["messages"][0]["content"][1]["text"],
             "answer": row["messages"][1]["content"][0]["text"]} for row in _shapes(8)]
    (root / "medpix.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _picture(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# ---- the Pillow twin ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("width", "height", "resized", "padded"), [
    (32, 32, (32, 32), (32, 32)),   # fits: 8 x 8 patches
    (20, 12, (12, 20), (16, 24)),   # never upscaled; padded to multiples of 8 (patch 4 x merge 2)
    (70, 50, (22, 32), (24, 32)),   # over 8 patches a side: both sides x 32 / 70, floored
])
def test_pillow_twin_sizes_patches_and_pixels(width, height, resized, padded):
    """Pixels: Pillow bicubic resize, zero padding at the bottom and right, (x / 255 - 0.5) / 0.5, then 4 x 4
    patches row by row, channels first; one image token per 2 x 2 patches in the processor's text."""
    assert kimi_k25_sizes(height, width, 4, 2, 16384, 8) == (resized, padded)
    processor = images_only_kimi_k25_class()(Kimi_K25ImageProcessorPil(**IMAGES), tiny_processor().tokenizer,
                                             chat_template=TEMPLATE)
    picture = _picture(width, height)
    out = processor(images=[picture], text=["<|media_pad|> what is it?"], return_tensors="pt")
    rows, columns = padded[0] // 4, padded[1] // 4
    assert out["image_grid_thw"].tolist() == [[1, rows, columns]]
    assert int((out["input_ids"] == processor.image_token_id).sum()) == rows * columns // 4
    assert processor.image_processor.get_number_of_image_patches(height, width) == rows * columns
    canvas = np.zeros((*padded, 3))
    canvas[:resized[0], :resized[1]] = np.asarray(picture.resize(resized[::-1], Image.Resampling.BICUBIC))
    values = ((canvas / 255.0 - MEAN) / STD).transpose(2, 0, 1)
    expected = [values[:, r * 4:(r + 1) * 4, c * 4:(c + 1) * 4] for r in range(rows) for c in range(columns)]
    np.testing.assert_allclose(out["pixel_values"].numpy(), np.stack(expected), atol=TOLERANCE, rtol=0)


def test_pillow_twin_saves_under_transformers_class_name_and_refuses_videos(tmp_path):
    processor = images_only_kimi_k25_class()(Kimi_K25ImageProcessorPil(**IMAGES), tiny_processor().tokenizer,
                                             chat_template=TEMPLATE)
    processor.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["processor_class"] == "Kimi_K25Processor"
    assert saved["image_processor"]["image_processor_type"] == "Kimi_K25ImageProcessor"
    with pytest.raises(ValueError, match="takes no videos"):
        processor(text=["x"], videos=[np.zeros((2, 32, 32, 3), dtype=np.uint8)])


@pytest.mark.skipif(not HAS_TORCHVISION, reason="compares with transformers' torchvision class")
def test_pillow_twin_matches_transformers_torchvision_class():
    from transformers import Kimi_K25ImageProcessor

    pictures = [_picture(70, 50, 1), _picture(20, 12, 2)]
    ours = Kimi_K25ImageProcessorPil(**IMAGES)(pictures, return_tensors="pt")
    theirs = Kimi_K25ImageProcessor(**IMAGES)(pictures, return_tensors="pt")
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert ours["pixel_values"].shape == theirs["pixel_values"].shape
    assert (ours["pixel_values"] - theirs["pixel_values"]).abs().mean() < 0.05  # resampling differs


# ---- the processor of a Kimi K2.5 checkpoint -----------------------------------------------------------------------

def test_a_checkpoint_naming_the_hubs_remote_code_processor_loads_transformers_class(tmp_path):
    """The hub's Kimi-K2.5 names its remote-code KimiK25Processor (auto_map): AutoProcessor would run it (trusted) or
    refuse; upstream's ``transformers.AutoProcessor.from_pretrained`` loads transformers' class here."""
    tiny_processor().save_pretrained(str(tmp_path))
    config = tmp_path / "processor_config.json"
    data = json.loads(config.read_text())
    data.update(processor_class="KimiK25Processor", auto_map={"AutoProcessor": "kimi_k25_processor.KimiK25Processor"})
    config.write_text(json.dumps(data))
    assert is_kimi_k25_checkpoint(str(tmp_path)) and not is_kimi_k25_checkpoint(str(TOKENIZER_DIR))
    from transformers import Kimi_K25Processor

    loaded = load_processor(str(tmp_path))
    assert isinstance(loaded, Kimi_K25Processor)
    assert type(loaded.image_processor).__name__ == ("Kimi_K25ImageProcessor" if HAS_TORCHVISION
                                                     else "Kimi_K25ImageProcessorPil")
    assert loaded.image_processor.patch_size == 4 and loaded.chat_template == TEMPLATE
    from automodel.plugins.manager import get_plugin_manager

    targets = get_plugin_manager().aliases.targets
    assert targets["transformers.AutoProcessor.from_pretrained"] == "automodel_vlm.processor.load_processor"


# ---- the collation -------------------------------------------------------------------------------------------------

def test_collation_labels_only_the_assistant_turns():
    processor = tiny_processor()
    batch = KimiK25Collator(processor)(_samples())
    tokenizer = processor.tokenizer
    for row, sample in enumerate(_shapes(2)):
        labelled = batch["labels"][row][batch["labels"][row] != IGNORE_INDEX]
        assert tokenizer.decode(labelled) == sample["messages"][1]["content"][0]["text"] + "<|im_end|>"
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8]] * 2
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == 2 * 16


def test_a_row_cut_inside_its_image_loses_the_image_as_upstreams_collate_does():
    """transformers' processor refuses a cut through image tokens; upstream's collate drops that row's images."""
    processor = tiny_processor()
    samples = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "yes"}]}], "images": []},
               *_samples(1)]
    with pytest.raises(ValueError, match="Mismatch in `image` token count"):
        VLMCollator(processor, max_length=12)(samples)
    batch = KimiK25Collator(processor, max_length=12)(samples)
    assert batch["input_ids"].shape == (2, 12) and "pixel_values" not in batch
    assert not (batch["input_ids"] == processor.image_token_id).any()
    assert (batch["attention_mask"][1] == 0).any()  # the image's remaining tokens are masked padding
    whole = KimiK25Collator(processor, max_length=30)(samples)  # the image fits: kept
    assert whole["pixel_values"].shape[0] == 64 and whole["image_grid_thw"].tolist() == [[1, 8, 8]]


def test_the_kimi_collate_function_refuses_another_models_processor():
    from vlm_testing import tiny_qwen_vl_processor

    with pytest.raises(AutomodelError, match="default_collate_fn"):
        KimiK25Collator(tiny_qwen_vl_processor())


# ---- upstream's form -----------------------------------------------------------------------------------------------

def _form_overrides(kimi_dir: Path, checkpoint_dir: Path) -> list:
    return ["--model.pretrained_model_name_or_path", kimi_dir / "model", "--processor.pretrained_model_name_or_path",
            kimi_dir / "model", "--dataset.path_or_dataset", kimi_dir / "medpix.jsonl",
            "--validation_dataset.path_or_dataset", kimi_dir / "medpix.jsonl", "--checkpoint.checkpoint_dir",
            checkpoint_dir]


def test_upstream_form_trains_two_steps_and_transformers_loads_the_saved_model(kimi_dir, tmp_path, capsys):
    from transformers import Kimi_K25ForConditionalGeneration

    batches = []

    def record(run) -> None:
        compute = run.compute_loss

        def computed(model, batch):
            batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
            return compute(model, batch)

        run.compute_loss = computed

    recipe = testing.train_inprocess(FORM, *_form_overrides(kimi_dir, tmp_path / "ckpt"), route=ROUTE,
                                     before_run=record)
    assert isinstance(recipe.model, Kimi_K25ForConditionalGeneration)
    assert isinstance(recipe.dataloader.collate_fn.fn, KimiK25Collator)
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [2]
    # without torchvision the run says once that the image processor is our Pillow twin and takes no videos
    log = capsys.readouterr().err
    assert log.count("our Pillow twin") == (0 if HAS_TORCHVISION else 1)
    assert ("takes no videos" in log) != HAS_TORCHVISION
    tokenizer = recipe.processor.tokenizer
    answers = {row["messages"][1]["content"][0]["text"] + "<|im_end|>" for row in _shapes(8)}
    train = [b for b in batches if b["input_ids"].shape[0] == 4][:2]
    assert len(train) == 2
    for batch in train:  # loss on the assistant tokens only: each row's labels are its answer and end of turn
        assert batch["input_ids"].shape[1] == 64 and "pixel_values" in batch
        for labels in batch["labels"]:
            assert tokenizer.decode(labels[labels != IGNORE_INDEX]) in answers
    saved = Kimi_K25ForConditionalGeneration.from_pretrained(tmp_path / "ckpt" / "epoch_0_step_2" / "model").eval()
    inputs = {k: v for k, v in train[0].items() if k in ("input_ids", "attention_mask", "pixel_values",
                                                          "image_grid_thw")}
    recipe.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(saved(**inputs).logits, recipe.model(**inputs).logits)
        fresh = Kimi_K25ForConditionalGeneration.from_pretrained(kimi_dir / "model").eval()
        assert not torch.allclose(fresh(**inputs).logits, saved(**inputs).logits)  # it trained


def test_upstreams_trust_remote_code_stays_the_command_lines_to_give(kimi_dir, tmp_path):
    with pytest.raises(ConfigError) as info:
        testing.load_config(FORM, *_form_overrides(kimi_dir, tmp_path), "--processor.trust_remote_code", "true",
                            route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert "--trust-remote-code" in found["processor.trust_remote_code"], found


@pytest.mark.parametrize(("target", "words"), [
    ("kimi_vl_collate_fn", "transformers has no Kimi-VL model"),
    ("phi4_mm_collate_fn", "torchcodec"),
])
def test_kimi_vl_and_phi4_mm_are_refused_with_their_reasons(kimi_dir, tmp_path, target, words):
    name = f"nemo_automodel.components.datasets.vlm.collate_fns.{target}"
    with pytest.raises(ConfigError) as info:
        testing.load_config(FORM, *_form_overrides(kimi_dir, tmp_path), "--dataloader.collate_fn._target_", name,
                            route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert words in found["dataloader.collate_fn._target_"] and "not implemented" not in str(found), found
