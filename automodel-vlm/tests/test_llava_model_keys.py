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
