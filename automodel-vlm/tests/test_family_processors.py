"""Upstream's own processor builders of Inkling, MiniMax-M3-VL and Step3.7 (family_processors.py): transformers'
processor class of each family, with upstream's fix-ups where transformers' class does not do them itself.

The three families' image processors are torchvision-backed (transformers has no Pillow twin of them): the tests
that build one need torchvision and are skipped without it; without it the builders' error says so."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from vlm_testing import LLAVA_CONFIG, TOKENIZER_DIR

from automodel import testing
from automodel.errors import AutomodelError, ConfigError
from automodel_vlm.family_processors import (
    INKLING_END_OF_SAMPLING,
    inkling_processor,
    minimax_m3_vl_processor,
    step3p7_processor,
)
from automodel_vlm.plugin import FAMILY_PROCESSORS

STEP3P7 = Path(__file__).parent / "upstream_forms" / "step3p7_upstream.yaml"
ROUTE = ("finetune", "vlm")
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
needs_torchvision = pytest.mark.skipif(not HAS_TORCHVISION, reason="the families' image processors need torchvision")
STEP3P7_TOKENS = ["<im_patch>", "<patch_start>", "<patch_end>", "<patch_newline>", "<im_start>", "<im_end>"]


def _tokenizer(special: list[str]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


@pytest.mark.parametrize("name", sorted(FAMILY_PROCESSORS))
def test_upstream_processor_builders_validate_and_resolve_to_ours(name):
    from automodel.plugins.manager import get_plugin_manager

    testing.load_config(STEP3P7, "--processor._target_", name, "--model.config", LLAVA_CONFIG, route=ROUTE)
    builder = get_plugin_manager().aliases.targets[name]
    assert builder == f"automodel_vlm.family_processors.{FAMILY_PROCESSORS[name]}"


def test_the_processors_trust_remote_code_stays_the_command_lines_to_give():
    with pytest.raises(ConfigError) as info:
        testing.load_config(STEP3P7, "--processor.trust_remote_code", "true", "--model.config", LLAVA_CONFIG,
                            route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert "--trust-remote-code" in found["processor.trust_remote_code"], found


@pytest.mark.skipif(HAS_TORCHVISION, reason="the error is for a machine without torchvision")
def test_without_torchvision_the_builder_says_what_is_missing(tmp_path):
    _tokenizer(STEP3P7_TOKENS).save_pretrained(str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text('{"image_processor_type": "Step3p7ImageProcessor"}')
    with pytest.raises(AutomodelError, match=r"processor.pretrained_model_name_or_path: cannot load Step3p7Processor "
                                             r"from .*torchvision"):
        step3p7_processor(str(tmp_path))


@needs_torchvision
def test_inkling_builder_gives_a_tokenizer_without_one_the_end_of_sampling_token(tmp_path):
    from transformers import InklingFeatureExtractor, InklingImageProcessor, InklingProcessor

    tokenizer = _tokenizer(["<|unused_200054|>", "<|unused_200053|>", "<|content_image|>", "<|content_audio_input|>",
                            INKLING_END_OF_SAMPLING])
    tokenizer.eos_token = None
    tokenizer.pad_token = None
    InklingProcessor(InklingFeatureExtractor(), InklingImageProcessor(), tokenizer,
                     chat_template=tokenizer.chat_template).save_pretrained(str(tmp_path))
    processor = inkling_processor(str(tmp_path))
    assert type(processor) is InklingProcessor
    end = tokenizer.convert_tokens_to_ids(INKLING_END_OF_SAMPLING)
    assert (processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id) == (end, end)


def _tiny_step3p7(root: Path) -> tuple[Path, Path]:
    """A saved Step3p7Processor (the shipped tokenizer with Step3.7's image tokens; a template that shows an image
    as its placeholder) and a tiny Step3p7 config that belongs to it: 4 global and 1 local image token per view."""
    from transformers import Step3p7Config, Step3p7ImageProcessor, Step3p7Processor

    tokenizer = _tokenizer(STEP3P7_TOKENS)
    template = tokenizer.chat_template.replace("'<image>'", "'<im_patch>'")
    processor = Step3p7Processor(Step3p7ImageProcessor(size={"height": 112, "width": 112}, patch_size=56), tokenizer,
                                 chat_template=template)
    processor.save_pretrained(str(root / "processor"))
    config = Step3p7Config(
        vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 112,
                       "patch_size": 14, "max_position_embeddings": 64},
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16,
                     "layer_types": ["sliding_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
                     "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "share_expert_dim": 32, "pad_token_id": tokenizer.pad_token_id},
        image_token_id=processor.image_token_id)
    config.save_pretrained(str(root / "model"))
    return root / "processor", root / "model" / "config.json"


@needs_torchvision
def test_step3p7_trains_two_steps_with_upstreams_processor_name(tmp_path):
    from transformers import Step3p7ForConditionalGeneration, Step3p7Processor

    processor_dir, config = _tiny_step3p7(tmp_path)
    recipe = testing.train_inprocess(STEP3P7, "--processor.pretrained_model_name_or_path", processor_dir,
                                     "--model.config", config, "--checkpoint.checkpoint_dir", tmp_path / "ckpt",
                                     route=ROUTE)
    assert type(recipe.processor) is Step3p7Processor
    assert isinstance(recipe.model, Step3p7ForConditionalGeneration)
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [2]


@needs_torchvision
def test_minimax_builder_keeps_the_checkpoints_chat_template_not_the_tokenizers(tmp_path):
    """Upstream's builder re-attaches chat_template.jinja, which the checkpoint's remote-code class dropped;
    transformers' class loads it itself (the shipped tokenizer's own template is another)."""
    from transformers import MiniMaxM3VLImageProcessor, MiniMaxM3VLProcessor, MiniMaxM3VLVideoProcessor

    tokenizer = _tokenizer(["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["])
    template = tokenizer.chat_template.replace("'<image>'", "']<]image[>['")
    assert template != tokenizer.chat_template
    MiniMaxM3VLProcessor(MiniMaxM3VLImageProcessor(), tokenizer, MiniMaxM3VLVideoProcessor(),
                         chat_template=template).save_pretrained(str(tmp_path))
    assert (tmp_path / "chat_template.jinja").is_file()
    processor = minimax_m3_vl_processor(str(tmp_path))
    assert type(processor) is MiniMaxM3VLProcessor
    assert processor.chat_template == template
