"""The Auto class named in "load it with ..." lines is the one transformers loads the saved architecture with."""

from __future__ import annotations

import pytest
import transformers

from automodel.auto_class import loading_auto_class

TINY = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "vocab_size": 64}


def _llava() -> transformers.PretrainedConfig:
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8)
    return transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(**TINY))


@pytest.mark.parametrize("config, architecture, auto", [
    (lambda: transformers.LlamaConfig(**TINY), "LlamaForCausalLM", "AutoModelForCausalLM"),
    (lambda: transformers.LlamaConfig(**TINY), "LlamaForSequenceClassification",
     "AutoModelForSequenceClassification"),
    (_llava, "LlavaForConditionalGeneration", "AutoModelForImageTextToText"),
    (lambda: transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64),
     "T5ForConditionalGeneration", "AutoModelForSeq2SeqLM"),
])
def test_the_named_class_builds_the_saved_architecture(tmp_path, config, architecture, auto):
    saved = config()
    saved.architectures = [architecture]
    saved.save_pretrained(tmp_path)
    assert loading_auto_class(tmp_path) == auto
    model = getattr(transformers, auto).from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert type(model).__name__ == architecture


def test_a_directory_without_a_readable_config_is_named_as_a_causal_lm(tmp_path):
    assert loading_auto_class(tmp_path) == "AutoModelForCausalLM"
    (tmp_path / "config.json").write_text("{not json")
    assert loading_auto_class(tmp_path) == "AutoModelForCausalLM"
