"""Upstream's NeMoAutoModel keyword arguments in a model section (automodel.model_kwargs): each acts or is refused
at validation with the reason; a key that is neither a from_pretrained argument nor a config attribute is refused
when built, naming it."""

from __future__ import annotations

import pytest
import torch
from llm_testing import validate_cli

from automodel.errors import AutomodelError, ConfigError
from automodel.testing import load_config
from automodel_llm import AutoModelForCausalLM

CUDA_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")


def refusals(config) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, route=("finetune", "llm"))
    return {issue.key: issue.message for issue in info.value.issues}


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory, tiny_llama_config):
    path = tmp_path_factory.mktemp("saved") / "llama"
    AutoModelForCausalLM.from_config(str(tiny_llama_config), seed=0).save_pretrained(path)
    return path


@pytest.mark.parametrize("keys, key, words", [
    ({"torch_dtype": "bf17"}, "model.torch_dtype", "'bf17' is not a floating dtype"),
    ({"dtype": "int8"}, "model.dtype", "not a floating dtype"),
    ({"use_liger_kernel": True}, "model.use_liger_kernel", "Liger's Triton kernels need a CUDA GPU"),
    ({"force_hf": False}, "model.force_hf", "upstream's own model implementation"),
    ({"use_liger_kernel": "no"}, "model.use_liger_kernel", "expected true or false, found 'no'"),
    ({"attn_implementation": "flash_attention_2"}, "model.attn_implementation", "the flash-attn package"),
    ({"attn_implementation": "te"}, "model.attn_implementation", "use sdpa or eager"),
    ({"attn_implementation": "ffpa"}, "model.attn_implementation", "FFPA's CuTe kernels"),
    ({"attn_implementation": "flash_attention_2", "backend": {"attn": "sdpa"}}, "model.attn_implementation",
     "needs a CUDA GPU"),
    ({"use_sdpa_patching": True, "attn_implementation": "eager"}, "model.use_sdpa_patching", "is 'eager'"),
    ({"sdpa_method": ["math"]}, "model.sdpa_method", "acts only with use_sdpa_patching: true"),
    ({"use_sdpa_patching": True, "sdpa_method": ["fast"]}, "model.sdpa_method", "'fast' is not an SDPA backend"),
    ({"mtp_loss_scaling_factor": 0.1}, "model.mtp_loss_scaling_factor", "multi-token-prediction heads"),
    ({"mtp_use_repeated_layer": True}, "model.mtp_use_repeated_layer", "multi-token-prediction heads"),
])
def test_upstream_model_keys_that_cannot_act_are_refused_with_the_reason(make_config, keys, key, words):
    found = refusals(make_config(model=keys))
    assert words in found[key], found


def test_an_attention_the_config_node_asks_for_is_refused_where_it_cannot_run(make_config, saved_llama):
    """Upstream's Nemotron-Flash form: the AutoConfig.from_pretrained node overrides the checkpoint's attention; a
    kernel this machine lacks is refused at validation (the build failed on it), sdpa validates. Its other key,
    ``attn_implementation_new``, is read by Nemotron-Flash's own code only: on a transformers Llama nothing reads it,
    so it is refused whatever its value."""
    node = {"_target_": "transformers.AutoConfig.from_pretrained", "pretrained_model_name_or_path": str(saved_llama)}
    found = refusals(make_config(model={"config": {**node, "_attn_implementation": "flash_attention_2"}}))
    assert "'flash_attention_2' needs a CUDA GPU" in found["model.config._attn_implementation"], found
    load_config(make_config(model={"config": {**node, "_attn_implementation": "sdpa"}}))
    found = refusals(make_config(model={"config": {**node, "attn_implementation_new": "sdpa"}}))
    assert "no transformers code for llama reads it" in found["model.config.attn_implementation_new"], found


@CUDA_ONLY
def test_sdpa_backends_that_run_only_on_cuda_are_refused(make_config):
    found = refusals(make_config(model={"use_sdpa_patching": True,
                                        "sdpa_method": ["efficient_attention", "cudnn_attention"]}))
    assert "run only on CUDA" in found["model.sdpa_method"]


@pytest.mark.parametrize("distributed", [{"pp_size": 2}, {"cp_size": 2}])
def test_sdpa_method_is_refused_where_the_model_forward_is_not_what_runs(make_config, distributed):
    found = refusals(make_config(model={"use_sdpa_patching": True, "sdpa_method": ["math"]},
                                 distributed={"strategy": "fsdp2", **distributed}))
    assert "a pipeline stage runs its part of the model without that forward" in found["model.sdpa_method"]


def test_upstream_model_keys_that_act_validate(make_config):
    keys = {"torch_dtype": "torch.BFloat16", "use_liger_kernel": False, "force_hf": True, "use_sdpa_patching": True,
            "sdpa_method": ["efficient_attention", "math"], "attn_implementation": "sdpa",
            "num_nextn_predict_layers": 0, "mtp_loss_scaling_factor": 0.1, "mtp_use_repeated_layer": False}
    _, cfg = load_config(make_config(model=keys), route=("finetune", "llm"))
    assert cfg.model.torch_dtype == "torch.BFloat16"


def test_from_pretrained_with_upstream_keys_builds_what_they_say(saved_llama):
    model = AutoModelForCausalLM.from_pretrained(saved_llama, torch_dtype="bf16", use_liger_kernel=False,
                                                 force_hf=True, use_sdpa_patching=False, num_nextn_predict_layers=0,
                                                 text_config={"use_cache": False}, output_hidden_states=True)
    assert model.dtype == torch.bfloat16
    assert model.config.use_cache is False and model.config.output_hidden_states is True
    assert not hasattr(model.config, "text_config") and not hasattr(model.config, "num_nextn_predict_layers")


def test_from_config_text_config_sets_the_text_model_key(tiny_llama_config):
    model = AutoModelForCausalLM.from_config(str(tiny_llama_config), text_config={"use_cache": False}, dtype="FP16")
    assert model.config.use_cache is False and model.dtype == torch.float16


@pytest.mark.parametrize("keys, words", [
    ({"bogus": 1}, "model.bogus: neither a from_pretrained argument nor an attribute of the llama config"),
    ({"text_config": {"nope": 1}}, "model.text_config.nope: not an attribute of the llama config"),
    ({"num_nextn_predict_layers": 2}, "model.num_nextn_predict_layers: 2 asks for upstream's multi-token-prediction"),
    ({"use_liger_kernel": True}, "model.use_liger_kernel: true is not supported"),
])
def test_a_key_that_cannot_act_is_refused_when_built(saved_llama, keys, words):
    with pytest.raises(AutomodelError, match="^" + words.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(saved_llama, **keys)


def test_sdpa_method_runs_the_forward_under_those_backends(saved_llama):
    seen = []
    plain = AutoModelForCausalLM.from_pretrained(saved_llama)
    model = AutoModelForCausalLM.from_pretrained(saved_llama, use_sdpa_patching=True, sdpa_method=["math"])
    for built in (plain, model):
        built.model.layers[0].self_attn.register_forward_pre_hook(
            lambda *_: seen.append(torch.backends.cuda.flash_sdp_enabled()))
    ids = torch.tensor([[1, 2, 3, 4]])
    patched_logits = model(ids).logits
    torch.testing.assert_close(patched_logits, plain(ids).logits)
    assert seen == [False, True]  # the patched model's attention ran under math only, the plain one as torch chose


def test_validate_names_the_key_and_exits_2(make_config, tmp_path):
    config = make_config(model={"torch_dtype": "bf17", "attn_implementation": "flash_attention_3"})
    code, output = validate_cli(config, tmp_path, subprocess=True)
    assert code == 2 and "Traceback" not in output, output
    assert "model.torch_dtype: 'bf17' is not a floating dtype" in output
    assert "model.attn_implementation: 'flash_attention_3' needs a CUDA GPU" in output


def test_a_key_the_config_lacks_is_refused_for_a_fresh_model_too(tiny_llama_config):
    with pytest.raises(AutomodelError, match=r"^model\.bogus: neither a from_pretrained argument"):
        AutoModelForCausalLM.from_pretrained(tiny_llama_config.parent, bogus=1)
    with pytest.raises(AutomodelError, match=r"^model\.bogus: neither a from_pretrained argument"):
        AutoModelForCausalLM.from_config(str(tiny_llama_config.parent), bogus=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_config.parent, output_hidden_states=True,
                                                 text_config={"use_cache": False})
    assert model.config.output_hidden_states is True and model.config.use_cache is False


def test_a_config_file_or_mapping_refuses_a_key_its_config_lacks_and_takes_the_others(tiny_llama_config):
    """from_config of a config.json file or a mapping: a key the config class lacks was kept as an attribute nothing
    read (a checkpoint's path among them: the run trained the fresh model); it is refused, naming it."""
    import json

    mapping = json.loads(tiny_llama_config.read_text())
    for config in (str(tiny_llama_config), mapping):
        with pytest.raises(AutomodelError, match=r"^model\.bogus: neither an argument of from_config nor an attribute "
                                                 r"of the llama config"):
            AutoModelForCausalLM.from_config(config, bogus=1)
        with pytest.raises(AutomodelError, match=r"^model\.pretrained_model_name_or_path: this model section builds "
                                                 r"a fresh model from model\.config .* end model\._target_ with "
                                                 r"from_pretrained"):
            AutoModelForCausalLM.from_config(config, pretrained_model_name_or_path="org/checkpoint")
        model = AutoModelForCausalLM.from_config(config, num_hidden_layers=1, num_nextn_predict_layers=0)
        assert len(model.model.layers) == 1


def test_validation_refuses_a_key_the_fresh_models_config_lacks(make_config, tiny_llama_config):
    """The same keys refused at validation (a config file, a mapping, a directory), keys of the config and of
    from_config itself accepted."""
    import json

    for config in (str(tiny_llama_config), json.loads(tiny_llama_config.read_text()), str(tiny_llama_config.parent)):
        model = {"_target_": "automodel_llm.AutoModelForCausalLM.from_config", "config": config}
        found = refusals(make_config(model={**model, "bogus": 1, "pretrained_model_name_or_path": "org/model"}))
        assert found["model.bogus"].startswith("neither an argument of from_config nor an attribute of the llama")
        assert "end model._target_ with from_pretrained" in found["model.pretrained_model_name_or_path"]
        load_config(make_config(model={**model, "num_hidden_layers": 1, "seed": 3, "attn_implementation": "eager",
                                       "use_liger_kernel": False, "num_nextn_predict_layers": 0}),
                    route=("finetune", "llm"))


@pytest.mark.parametrize("model_type, keys, key", [
    ("gpt_oss", {"attn_implementation": "sdpa"}, "model.attn_implementation"),
    ("gemma2", {"backend": {"attn": "sdpa"}}, "model.backend.attn"),
])
def test_an_attention_the_model_class_lacks_is_refused_at_validation(make_config, tmp_path, model_type, keys, key):
    # upstream's GPT-OSS example asks for sdpa (its own model code has it); transformers' class refuses it when built
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, vocab_size=482, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16).save_pretrained(tmp_path / "m")
    found = refusals(make_config(model={"config": str(tmp_path / "m" / "config.json"), **keys}))
    assert "has no sdpa attention in transformers" in found[key] and found[key].endswith("use eager"), found
    load_config(make_config(model={"config": str(tmp_path / "m" / "config.json"), "attn_implementation": "eager"}),
                route=("finetune", "llm"))


def test_a_model_type_transformers_builds_only_as_image_text_to_text_is_built_so(tmp_path):
    """Upstream's NeMoAutoModelForCausalLM builds the architecture a checkpoint names (its Muse Glimmer examples
    load a vision-language model through it); transformers' AutoModelForCausalLM refuses such a config."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    text = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    vision = {"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 16, "patch_size": 8}
    LlavaConfig(text_config=text, vision_config=vision, image_token_id=3).save_pretrained(tmp_path / "fresh")
    LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=3)
                                  ).save_pretrained(tmp_path / "saved")
    assert isinstance(AutoModelForCausalLM.from_config(str(tmp_path / "fresh")), LlavaForConditionalGeneration)
    assert isinstance(AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved")), LlavaForConditionalGeneration)
    assert type(AutoModelForCausalLM.from_config({"model_type": "llama", **text})).__name__ == "LlamaForCausalLM"


def test_trust_remote_code_and_config_keys_still_build_on_the_meta_device(tmp_path):
    """Upstream's configs ask for trust_remote_code (and set config keys) for models transformers implements: the
    engine's meta-device build (each rank reads only its shards) still applies, the keys set on the config; a
    checkpoint that ships its own code (auto_map) is left to from_pretrained."""
    import json

    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from automodel.meta_build import building_on_meta

    HFLlama(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path)
    with building_on_meta() as request:
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True, output_hidden_states=True)
    assert request.built and request.weights == tmp_path
    assert all(p.is_meta for p in model.parameters()) and model.config.output_hidden_states is True
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "own.Model"}}))
    (tmp_path / "own.py").write_text("from transformers import LlamaForCausalLM\n\n\n"  # a class of its own: loading
                                     "class Model(LlamaForCausalLM):\n    pass\n")  # marks it as remote code
    with building_on_meta() as request:
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True)
    assert not request.built and not any(p.is_meta for p in model.parameters())
    assert request.declined == f"the checkpoint in {tmp_path} runs its own code (auto_map, trust_remote_code)"
    with building_on_meta() as request:  # the run's log line says why (recipe.after_model_built)
        AutoModelForCausalLM.from_pretrained(str(tmp_path), revision="main")
    assert not request.built and request.declined == "from_pretrained loads it with revision"


def test_load_base_model_reads_the_weights_of_the_checkpoint_the_config_came_from(saved_llama):
    """Upstream's ``from_config(config, load_base_model=True)`` (its DeepSeek-V4, MiMo-V2, Kimi Linear configs): the
    model of the config as changed here, its weights the checkpoint's; without the key, fresh weights."""
    from transformers import LlamaConfig

    expected = AutoModelForCausalLM.from_pretrained(str(saved_llama)).state_dict()
    # a directory; a config class's from_pretrained with name_or_path, as upstream's config nodes give it
    for config in (str(saved_llama), LlamaConfig.from_pretrained(str(saved_llama), name_or_path=str(saved_llama))):
        loaded = AutoModelForCausalLM.from_config(config, load_base_model=True).state_dict()
        assert all(torch.equal(loaded[key], value) for key, value in expected.items())
    fresh = AutoModelForCausalLM.from_config(str(saved_llama), seed=3).state_dict()
    assert not torch.equal(fresh["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])
    one_layer = AutoModelForCausalLM.from_config(str(saved_llama), load_base_model=True, num_hidden_layers=1)
    assert one_layer.config.num_hidden_layers == 1
    assert torch.equal(one_layer.state_dict()["model.layers.0.mlp.up_proj.weight"],
                       expected["model.layers.0.mlp.up_proj.weight"])


def test_load_base_model_of_a_config_that_names_no_checkpoint_is_refused(saved_llama):
    from transformers import LlamaConfig

    for config in (str(saved_llama / "config.json"), LlamaConfig.from_pretrained(str(saved_llama))):
        with pytest.raises(AutomodelError, match="give model.config.name_or_path"):
            AutoModelForCausalLM.from_config(config, load_base_model=True)
