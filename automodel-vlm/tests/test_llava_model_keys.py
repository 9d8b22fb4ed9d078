"""Upstream's model keys on a composite (Llava) model: ``text_config`` sets the text model's keys, the rest of the
sub-config stays the checkpoint's; ``torch_dtype: bf16`` and ``output_hidden_states`` act."""

from __future__ import annotations

import pytest
import torch
from vlm_testing import LLAVA_CONFIG

from automodel.errors import AutomodelError
from automodel_vlm.models import AutoModelForImageTextToText


@pytest.fixture(scope="module")
def saved_llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "llava"
    AutoModelForImageTextToText.from_config(str(LLAVA_CONFIG.parent), seed=0).save_pretrained(path)
    return path


def test_text_config_and_dtype_act_on_a_composite_model(saved_llava):
    model = AutoModelForImageTextToText.from_pretrained(saved_llava, torch_dtype="bf16", use_liger_kernel=False,
                                                        text_config={"use_cache": False}, output_hidden_states=True)
    saved = AutoModelForImageTextToText.from_pretrained(saved_llava).config
    assert model.dtype == torch.bfloat16 and model.config.output_hidden_states is True
    assert model.config.text_config.use_cache is False and saved.text_config.use_cache is True
    assert model.config.text_config.hidden_size == saved.text_config.hidden_size


def test_an_unknown_text_config_key_is_refused_naming_it(saved_llava):
    with pytest.raises(AutomodelError, match=r"^model\.text_config\.nope: not an attribute of the llama config"):
        AutoModelForImageTextToText.from_pretrained(saved_llava, text_config={"nope": 1})


def test_a_fresh_model_refuses_a_key_its_config_lacks_and_takes_the_others():
    """from_config (a config.json file or directory): a key the config class lacks was kept as an attribute nothing
    read (a checkpoint's path among them); it is refused, naming it, and a key of the config acts."""
    for config in (str(LLAVA_CONFIG), str(LLAVA_CONFIG.parent)):
        with pytest.raises(AutomodelError, match=r"^model\.bogus: neither an argument of from_config nor an attribute "
                                                 r"of the llava config"):
            AutoModelForImageTextToText.from_config(config, bogus=1)
        with pytest.raises(AutomodelError, match=r"^model\.pretrained_model_name_or_path: .* end model\._target_ "
                                                 r"with from_pretrained"):
            AutoModelForImageTextToText.from_config(config, pretrained_model_name_or_path="org/checkpoint")
        assert AutoModelForImageTextToText.from_config(config, image_token_id=7).config.image_token_id == 7


def sdpa_calls(model, monkeypatch) -> int:
    """How many times a forward of ``model`` on one picture and its prompt calls torch's SDPA."""
    from PIL import Image
    from vlm_testing import tiny_processor

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(1) or sdpa(*args, **kwargs))
    processor = tiny_processor()
    batch = processor(images=[Image.new("RGB", (32, 32), (200, 30, 30))], text=["<image> What colour?"],
                      return_tensors="pt")
    with torch.no_grad():
        model(**batch)
    monkeypatch.undo()
    return len(calls)


@pytest.mark.parametrize(("attn", "explicit"), [("sdpa", "eager"), ("eager", "sdpa")])
def test_backend_attn_is_the_language_models_and_attn_implementation_the_vision_towers(attn, explicit, monkeypatch):
    """Upstream's composite form (Gemma 4 26B-A4B: backend.attn for its own language model, attn_implementation for
    the Hugging Face vision tower): each part runs its own; validation takes the pair for an image-text-to-text
    model and still refuses it for a causal LM, which has one attention."""
    from automodel.model_kwargs import composite_model_issues, mtp_model_issues

    node = {"backend": {"attn": attn}, "attn_implementation": explicit}
    assert composite_model_issues(node) == {}
    assert "give one of them" in mtp_model_issues(node)["backend.attn"]
    model = AutoModelForImageTextToText.from_config(str(LLAVA_CONFIG.parent), seed=0, **node)
    assert model.config.text_config._attn_implementation == attn
    assert model.config.vision_config._attn_implementation == explicit
    layers = model.config.text_config.num_hidden_layers  # as many as the vision tower's (2 each)
    assert sdpa_calls(model, monkeypatch) == layers
    for same in ("sdpa", "eager"):  # one attention for both parts: SDPA in all four layers or in none
        whole = AutoModelForImageTextToText.from_config(str(LLAVA_CONFIG.parent), seed=0, backend={"attn": same},
                                                        attn_implementation=same)
        assert sdpa_calls(whole, monkeypatch) == (2 * layers if same == "sdpa" else 0)


def test_a_model_without_a_language_model_apart_refuses_two_attentions():
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel.model_backend import use_language_model_attention

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    with pytest.raises(AutomodelError, match="no language model apart from the rest .*: give one of them"):
        use_language_model_attention(model, "sdpa")
