"""Upstream's own processor builders of Inkling, MiniMax-M3-VL and Step3.7 (family_processors.py): transformers'
processor class of each family, with upstream's fix-ups where transformers' class does not do them itself.

The three families' image processors are torchvision-backed in transformers; without torchvision (this machine)
the builders load our Pillow twins of them (image_processors.py; test_image_processors.py checks their outputs),
and MiniMax's processor is images-only (its video processor needs torchvision). The tiny processors here are built
from whichever classes the builders would load. Pixtral / Mistral 3: transformers gates its PixtralProcessor itself
on torchvision, so without it a checkpoint's processor loads as our twin of that class (with transformers' Pillow
Pixtral image processor); a tiny Mistral 3 trains two steps of upstream's Ministral 3 form."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from vlm_testing import LLAVA_CONFIG, SHAPES, TOKENIZER_DIR, clone_state

from automodel import testing
from automodel.errors import ConfigError
from automodel_vlm.family_processors import (
    INKLING_END_OF_SAMPLING,
    images_only_minimax_class,
    inkling_processor,
    minimax_m3_vl_processor,
    pillow_twin_note,
    pixtral_processor_class,
    step3p7_processor,
)
from automodel_vlm.parts import find_part
from automodel_vlm.plugin import FAMILY_PROCESSORS
from automodel_vlm.processor import build_processor, is_pixtral_checkpoint, load_processor

FORM = Path(__file__).parent / "upstream_forms" / "family_processor_upstream.yaml"
ROUTE = ("finetune", "vlm")
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
_MODELS = "nemo_automodel.components.models"
INKLING_TOKENS = ["<|unused_200054|>", "<|unused_200053|>", "<|content_image|>", "<|content_audio_input|>",
                  INKLING_END_OF_SAMPLING]
MINIMAX_TOKENS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]
STEP3P7_TOKENS = ["<im_patch>", "<patch_start>", "<patch_end>", "<patch_newline>", "<im_start>", "<im_end>"]


def _tokenizer(special: list[str]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


@pytest.mark.parametrize("name", sorted(FAMILY_PROCESSORS))
def test_upstream_processor_builders_validate_and_resolve_to_ours(name):
    from automodel.plugins.manager import get_plugin_manager

    testing.load_config(FORM, "--processor._target_", name, "--model.config", LLAVA_CONFIG, route=ROUTE)
    builder = get_plugin_manager().aliases.targets[name]
    assert builder == f"automodel_vlm.family_processors.{FAMILY_PROCESSORS[name]}"


def test_the_processors_trust_remote_code_stays_the_command_lines_to_give():
    with pytest.raises(ConfigError) as info:
        testing.load_config(FORM, "--processor.trust_remote_code", "true", "--model.config", LLAVA_CONFIG,
                            route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert "--trust-remote-code" in found["processor.trust_remote_code"], found


@pytest.mark.skipif(HAS_TORCHVISION, reason="the Pillow twins stand in only without torchvision")
@pytest.mark.parametrize("family", ["inkling", "minimax_m3_vl", "step3p7"])
def test_without_torchvision_the_builders_load_our_pillow_twins(family, tmp_path):
    """A processor saved as transformers would save it (the image processor under its torchvision class's name)
    loads with the twin, its settings kept, and the recipe's log line says so."""
    builder = {"inkling": inkling_processor, "minimax_m3_vl": minimax_m3_vl_processor,
               "step3p7": step3p7_processor}[family]
    processor, _ = FAMILIES[family][1]()
    processor.save_pretrained(str(tmp_path))
    saved = (tmp_path / "processor_config.json").read_text()
    assert f'"image_processor_type": "{type(processor.image_processor).__name__.removesuffix("Pil")}"' in saved
    loaded = builder(str(tmp_path), trust_remote_code=False)
    assert type(loaded.image_processor) is type(processor.image_processor)
    assert loaded.image_processor.to_dict() == processor.image_processor.to_dict()
    note = pillow_twin_note(loaded)
    assert note and "torchvision is not installed" in note and type(processor.image_processor).__name__ in note
    assert ("takes no videos" in note) == (family == "minimax_m3_vl")


def _family_tokenizer(tokens: list[str], image_text: str) -> tuple[object, str]:
    """The shipped tokenizer with a family's special tokens, and its template showing an image as ``image_text``."""
    tokenizer = _tokenizer(tokens)
    return tokenizer, tokenizer.chat_template.replace("'<image>'", f"'{image_text}'")


def _image_processor(name: str, **settings) -> object:
    """transformers' torchvision class ``name``, or (without torchvision) our Pillow twin of it."""
    import transformers

    from automodel_vlm import image_processors

    return (getattr(transformers, name) if HAS_TORCHVISION else getattr(image_processors, name + "Pil"))(**settings)


def _tiny_inkling() -> tuple[object, object]:
    from transformers import InklingConfig, InklingFeatureExtractor, InklingProcessor

    tokenizer, template = _family_tokenizer(INKLING_TOKENS, "<|content_image|><|unused_200054|>")
    processor = InklingProcessor(InklingFeatureExtractor(), _image_processor("InklingImageProcessor"), tokenizer,
                                 chat_template=template)
    config = InklingConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 32, "swa_num_attention_heads": 2,
                     "swa_num_key_value_heads": 1, "swa_head_dim": 32, "sliding_window_size": 16, "rel_extent": 64,
                     "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_shared_experts": 1, "pad_token_id": tokenizer.pad_token_id},
        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "text_hidden_size": 64},
        audio_config={"text_hidden_size": 64}, image_token_id=processor.image_token_id,
        audio_token_id=processor.audio_token_id, image_bos_token_id=processor.image_bos_token_id,
        audio_bos_token_id=processor.audio_bos_token_id)
    return processor, config


def _tiny_minimax_m3_vl() -> tuple[object, object]:
    from transformers import MiniMaxM3VLConfig

    tokenizer, template = _family_tokenizer(MINIMAX_TOKENS, "]<]image[>[")
    images = _image_processor("MiniMaxM3VLImageProcessor")
    if HAS_TORCHVISION:
        from transformers import MiniMaxM3VLProcessor, MiniMaxM3VLVideoProcessor

        processor = MiniMaxM3VLProcessor(images, tokenizer, MiniMaxM3VLVideoProcessor(), chat_template=template)
    else:
        processor = images_only_minimax_class()(images, tokenizer, chat_template=template)
    config = MiniMaxM3VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "dense_intermediate_size": 128, "shared_intermediate_size": 32,
                     "rotary_dim": 16, "index_head_dim": 16, "index_block_size": 8,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, "eos_token_id": None},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
        projector_hidden_size=64, image_token_index=processor.image_token_id,
        video_token_index=processor.video_token_id)
    return processor, config


def _tiny_step3p7() -> tuple[object, object]:
    """4 global and 1 local image token per view (112-pixel views, 56-pixel local crops)."""
    from transformers import Step3p7Config, Step3p7Processor

    tokenizer, template = _family_tokenizer(STEP3P7_TOKENS, "<im_patch>")
    images = _image_processor("Step3p7ImageProcessor", size={"height": 112, "width": 112}, patch_size=56)
    processor = Step3p7Processor(images, tokenizer, chat_template=template)
    config = Step3p7Config(
        vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 112,
                       "patch_size": 14, "max_position_embeddings": 64},
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16,
                     "layer_types": ["sliding_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
                     "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "share_expert_dim": 32, "pad_token_id": tokenizer.pad_token_id},
        image_token_id=processor.image_token_id)
    return processor, config


# family -> (upstream's processor builder, the tiny processor and model config, transformers' model class)
FAMILIES = {
    "inkling": (f"{_MODELS}.inkling.processing.build_inkling_processor", _tiny_inkling,
                "InklingForConditionalGeneration"),
    "minimax_m3_vl": (f"{_MODELS}.minimax_m3_vl.processing.build_minimax_m3_vl_processor", _tiny_minimax_m3_vl,
                      "MiniMaxM3SparseForConditionalGeneration"),
    "step3p7": (f"{_MODELS}.step3p7.processing_step3.Step3VLProcessor.from_pretrained", _tiny_step3p7,
                "Step3p7ForConditionalGeneration"),
}


def test_inkling_builder_gives_a_tokenizer_without_one_the_end_of_sampling_token(tmp_path):
    processor, _ = _tiny_inkling()
    processor.tokenizer.eos_token = None
    processor.tokenizer.pad_token = None
    processor.save_pretrained(str(tmp_path))
    loaded = inkling_processor(str(tmp_path))
    assert type(loaded) is type(processor)
    end = processor.tokenizer.convert_tokens_to_ids(INKLING_END_OF_SAMPLING)
    assert (loaded.tokenizer.eos_token_id, loaded.tokenizer.pad_token_id) == (end, end)


def test_minimax_builder_keeps_the_checkpoints_chat_template(tmp_path):
    """Upstream's builder re-attaches chat_template.jinja, which the checkpoint's remote-code class dropped;
    transformers' class loads it itself (the shipped tokenizer's own template is another)."""
    processor, _ = _tiny_minimax_m3_vl()
    processor.save_pretrained(str(tmp_path))
    assert (tmp_path / "chat_template.jinja").is_file()
    loaded = minimax_m3_vl_processor(str(tmp_path))
    assert type(loaded) is type(processor)
    assert loaded.chat_template == processor.chat_template != _tokenizer([]).chat_template


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_trains_two_steps_with_upstreams_processor_name(family, tmp_path, capsys):
    name, tiny, model_class = FAMILIES[family]
    processor, config = tiny()
    processor.save_pretrained(str(tmp_path / "processor"))
    config.save_pretrained(str(tmp_path / "model"))
    vision: dict = {}

    def keep_vision_tower(run) -> None:  # the images reach the model: its vision tower learns
        vision.update(clone_state(find_part(run.model, "vision_tower")[1]))

    recipe = testing.train_inprocess(FORM, "--processor._target_", name, "--processor.pretrained_model_name_or_path",
                                     tmp_path / "processor", "--model.config", tmp_path / "model" / "config.json",
                                     "--checkpoint.checkpoint_dir", tmp_path / "ckpt", route=ROUTE,
                                     before_run=keep_vision_tower)
    assert type(recipe.processor) is type(processor)
    assert type(recipe.model).__name__ == model_class
    trained = find_part(recipe.model, "vision_tower")[1].state_dict()
    assert vision and any(not torch.equal(trained[k], v) for k, v in vision.items())
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [2]
    # without torchvision the run says once that the image processor is our Pillow twin
    assert capsys.readouterr().err.count("our Pillow twin") == (0 if HAS_TORCHVISION else 1)


# ---- Pixtral / Mistral 3: transformers' PixtralProcessor needs torchvision; without it, our twin of it ------------

MINISTRAL3_FORM = Path(__file__).parent / "upstream_forms" / "ministral3_upstream.yaml"
PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def tiny_pixtral_processor(longest_edge: int = 32):
    """The shipped tokenizer with Pixtral's image tokens, its template writing an image as ``[IMG]``; 4-pixel patches
    merged 2 x 2 (an image is sized in multiples of 8, each 8 x 8 block one ``[IMG]``)."""
    from transformers import PixtralImageProcessorPil

    tokenizer, template = _family_tokenizer(PIXTRAL_TOKENS, "[IMG]")
    images = PixtralImageProcessorPil(patch_size=4, size={"longest_edge": longest_edge})
    cls = pixtral_processor_class()
    if HAS_TORCHVISION:
        from transformers import PixtralProcessor as cls
    return cls(images, tokenizer, patch_size=4, spatial_merge_size=2, chat_template=template)


def tiny_mistral3_dir(path: Path) -> Path:
    """A tiny Mistral 3 (fresh weights; Pixtral tower of 4-pixel patches up to 32 pixels, merged 2 x 2) saved in
    ``path`` with its processor, as transformers saves them (and a hub download holds them)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    processor = tiny_pixtral_processor()
    tokenizer = processor.tokenizer
    config = Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": len(tokenizer),
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 32, "patch_size": 4},
        image_token_index=processor.image_token_id, spatial_merge_size=2)
    torch.manual_seed(0)
    Mistral3ForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(str(path))
    return path


def _medpix_rows(path: Path, count: int = 4) -> Path:
    """MedPix-form rows (``image_id``, ``question``, ``answer``) of the shipped shapes pictures."""
    import json

    rows = [json.loads(line) for line in (SHAPES / "train.jsonl").read_text().splitlines()[:count]]
    path.write_text("".join(json.dumps({
        "image_id": str(SHAPES / row["image"]), "question": row["messages"][0]["content"][1]["text"],
        "answer": row["messages"][1]["content"][0]["text"]}) + "\n" for row in rows))
    return path


def test_a_saved_pixtral_processor_loads_and_names_transformers_classes(tmp_path):
    """Saved, the processor names transformers' classes (a machine with torchvision loads them); loaded here it is
    our twin (without torchvision), its settings kept; built from its parts by name, the same class."""
    import json

    processor = tiny_pixtral_processor(longest_edge=48)
    processor.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["processor_class"] == "PixtralProcessor"
    assert saved["image_processor"]["image_processor_type"] == "PixtralImageProcessor"
    loaded = load_processor(str(tmp_path))
    assert type(loaded) is type(processor)
    assert (loaded.patch_size, loaded.spatial_merge_size) == (4, 2)
    assert loaded.image_processor.size == {"longest_edge": 48}
    assert loaded.image_token_ids == processor.tokenizer.convert_tokens_to_ids(PIXTRAL_TOKENS)
    assert (pillow_twin_note(loaded) is None) == HAS_TORCHVISION
    built = build_processor({"image_processor_type": "PixtralImageProcessor", "patch_size": 4,
                             "size": {"longest_edge": 48}}, str(tmp_path), processor_class="PixtralProcessor",
                            patch_size=4, spatial_merge_size=2)
    assert type(built) is type(processor) and built.image_token_ids == loaded.image_token_ids


def test_which_checkpoints_are_pixtral(tmp_path):
    """The processor class a processor / preprocessor config names decides; without one, config.json's model type
    (AutoProcessor's fallback: Mistral 3's processor is PixtralProcessor)."""
    import json

    def checkpoint(name: str, **files: dict) -> str:
        (tmp_path / name).mkdir()
        for file, data in files.items():
            (tmp_path / name / f"{file}.json").write_text(json.dumps(data))
        return str(tmp_path / name)

    assert is_pixtral_checkpoint(checkpoint("named", processor_config={"processor_class": "PixtralProcessor"}))
    assert is_pixtral_checkpoint(checkpoint("pre", preprocessor_config={"processor_class": "PixtralProcessor"}))
    assert is_pixtral_checkpoint(checkpoint("typed", config={"model_type": "mistral3"}))
    assert not is_pixtral_checkpoint(checkpoint("llava", processor_config={"processor_class": "LlavaProcessor"},
                                                config={"model_type": "mistral3"}))
    assert not is_pixtral_checkpoint(checkpoint("other", config={"model_type": "llava"}))


def test_upstreams_ministral3_form_trains_two_steps(tmp_path, capsys):
    """Upstream's Ministral 3 form (no processor: section: the model directory's PixtralProcessor) trains two steps
    with the vision tower learning; without torchvision it loads our twin of the processor and says so."""
    model_dir, rows = tiny_mistral3_dir(tmp_path / "model"), _medpix_rows(tmp_path / "medpix.jsonl")
    vision: dict = {}

    def keep_vision_tower(run) -> None:
        vision.update(clone_state(find_part(run.model, "vision_tower")[1]))

    recipe = testing.train_inprocess(
        MINISTRAL3_FORM, "--model.pretrained_model_name_or_path", model_dir, "--dataset.path_or_dataset", rows,
        "--validation_dataset.path_or_dataset", rows,
        "--checkpoint.checkpoint_dir", tmp_path / "ckpt", route=ROUTE, before_run=keep_vision_tower)
    assert type(recipe.model).__name__ == "Mistral3ForConditionalGeneration"
    assert type(recipe.processor).__name__ == ("PixtralProcessor" if HAS_TORCHVISION else "PixtralProcessorPil")
    trained = find_part(recipe.model, "vision_tower")[1].state_dict()
    assert vision and any(not torch.equal(trained[k], v) for k, v in vision.items())
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [2]
    assert capsys.readouterr().err.count("PixtralProcessorPil, our twin") == (0 if HAS_TORCHVISION else 1)
