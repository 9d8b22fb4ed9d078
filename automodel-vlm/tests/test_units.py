"""Units: the freeze stage's switches, LoRA target selection, the processor section, model building, the plugin."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from vlm_testing import EXAMPLE, IMAGE_PROCESSOR_DIR, LLAVA_CONFIG, TOKENIZER_DIR, train_inprocess

from automodel.errors import AutomodelError
from automodel_vlm import AutoModelForImageTextToText
from automodel_vlm.freeze import VLMFreezeConfig, freeze_vlm
from automodel_vlm.peft import language_model_targets


def tiny_model(**overrides):
    return AutoModelForImageTextToText.from_config(str(LLAVA_CONFIG), seed=0, **overrides)


class FreezeOnly(SimpleNamespace):
    """A config holding only a ``freeze`` section (no upstream ``freeze_config``)."""

    def __contains__(self, name: str) -> bool:
        return name in vars(self)


def frozen_after(model, **settings) -> dict[str, bool]:
    """Per top-level part: whether ALL its parameters are frozen (True), all trainable (False), or mixed (None)."""
    freeze_vlm(SimpleNamespace(cfg=FreezeOnly(freeze=VLMFreezeConfig(**settings))), model)
    parts = {"vision": "model.vision_tower.", "projector": "model.multi_modal_projector.",
             "embeddings": "model.language_model.embed_tokens.", "layers": "model.language_model.layers.",
             "head": "lm_head."}
    out = {}
    for part, prefix in parts.items():
        flags = {not p.requires_grad for n, p in model.named_parameters() if n.startswith(prefix)}
        out[part] = flags.pop() if len(flags) == 1 else None
    return out


@pytest.mark.parametrize(("settings", "expected"), [
    ({}, {"vision": True, "projector": False, "embeddings": False, "layers": False, "head": False}),
    ({"vision_tower": False}, {"vision": False, "projector": False, "embeddings": False, "layers": False,
                               "head": False}),
    ({"language_model": True}, {"vision": True, "projector": False, "embeddings": True, "layers": True,
                                "head": True}),
    ({"embeddings": True}, {"vision": True, "projector": False, "embeddings": True, "layers": False, "head": False}),
    ({"multi_modal_projector": True, "vision_tower": False},
     {"vision": False, "projector": True, "embeddings": False, "layers": False, "head": False}),
    ({"unfreeze_modules": ["model.vision_tower.encoder.layers.1"]},
     {"vision": None, "projector": False, "embeddings": False, "layers": False, "head": False}),
    ({"vision_tower": False, "patterns": ["*.layers.0.*"]},
     {"vision": None, "projector": False, "embeddings": False, "layers": None, "head": False}),
])
def test_freeze_switches(settings, expected):
    assert frozen_after(tiny_model(), **settings) == expected


def test_freeze_unfreeze_keeps_exactly_the_named_module():
    model = tiny_model()
    frozen_after(model, unfreeze_modules=["model.vision_tower.encoder.layers.1"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad and ".vision_tower." in n}
    assert trainable and all(n.startswith("model.vision_tower.encoder.layers.1.") for n in trainable)


def test_freeze_of_a_part_the_model_lacks_is_a_clear_error():
    from transformers import AutoModelForCausalLM, LlamaConfig

    text = json.loads(LLAVA_CONFIG.read_text())["text_config"]
    text.pop("model_type")
    llm = AutoModelForCausalLM.from_config(LlamaConfig(**text))
    with pytest.raises(AutomodelError, match=r"^freeze.vision_tower: LlamaForCausalLM has no module named like "
                                             r"vision_tower"):
        frozen_after(llm)


def test_lora_targets_only_the_language_model_linear_layers():
    model = tiny_model()
    names = language_model_targets(model, "all-linear")
    assert names and all(n.startswith("model.language_model.layers.") for n in names)
    assert len(names) == 2 * 7  # q k v o gate up down, two layers; never lm_head, the projector or the tower
    assert language_model_targets(model, {"q_proj", "v_proj"}) == [
        f"model.language_model.layers.{i}.self_attn.{m}_proj" for i in range(2) for m in ("q", "v")]
    # upstream's own VLM classes (Muse Glimmer's) name the decoder as a causal LM does: model.layers.*
    assert language_model_targets(model, ["model.layers.*.self_attn.q_proj", "model.layers.1.mlp.up_proj"]) == [
        "model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.1.self_attn.q_proj",
        "model.language_model.layers.1.mlp.up_proj"]
    with pytest.raises(AutomodelError, match="matches no linear layer"):
        language_model_targets(model, ["fc1"])  # a vision-tower layer name


def test_lora_with_frozen_language_model_keeps_adapters_trainable(make_config):
    config = make_config(peft={"dim": 2, "target_modules": ["q_proj", "v_proj"]}, freeze={"language_model": True})
    recipe = train_inprocess(config, setup_only=True)
    trainable = [n for n, p in recipe.model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * 2 and all("lora_" in n and ".language_model." in n for n in trainable)


def test_processor_built_from_parts_saves_and_reloads(processor, tmp_path):
    from transformers import AutoProcessor

    from automodel_vlm.processor import load_processor

    assert type(processor).__name__ == "LlavaProcessor"
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"  # Pillow, no torchvision
    assert processor.image_token_id == json.loads(LLAVA_CONFIG.read_text())["image_token_index"]
    assert processor.chat_template == processor.tokenizer.chat_template
    processor.save_pretrained(str(tmp_path))
    for again in (load_processor(str(tmp_path)), AutoProcessor.from_pretrained(str(tmp_path))):
        assert again.image_token_id == processor.image_token_id and again.patch_size == 8
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
        assert again.apply_chat_template(messages, add_generation_prompt=True) == \
            "<s>user:<image> Hi\nassistant:"


def test_processor_errors_name_their_key(tmp_path):
    from automodel_vlm.processor import build_processor, load_processor

    with pytest.raises(AutomodelError, match=r"^processor.processor_class: 'NoSuchProcessor'"):
        build_processor(str(IMAGE_PROCESSOR_DIR), str(TOKENIZER_DIR), processor_class="NoSuchProcessor")
    with pytest.raises(AutomodelError, match=r"^processor.tokenizer: cannot load a tokenizer from"):
        build_processor(str(IMAGE_PROCESSOR_DIR), str(tmp_path / "none"))
    with pytest.raises(AutomodelError, match=r"^processor.image_processor: a mapping needs 'image_processor_type'"):
        build_processor({"size": {"shortest_edge": 32}}, str(TOKENIZER_DIR))
    with pytest.raises(AutomodelError, match=r"^processor.pretrained_model_name_or_path: '.*' does not exist"):
        load_processor(str(tmp_path / "missing"))
    built = build_processor({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 32},
                             "crop_size": {"height": 32, "width": 32}}, {"pretrained_model_name_or_path":
                                                                           str(TOKENIZER_DIR)},
                            patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    assert built.image_processor.crop_size["height"] == 32


def test_a_run_without_processor_section_needs_a_model_directory(make_config):
    from automodel.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^invalid configuration: processor: missing: the model is not loaded"):
        train_inprocess(make_config(processor=None), setup_only=True)


def test_a_processor_section_without_target_or_path_reads_the_models_processor(make_config, tmp_path):
    """Upstream's rule: `processor: {padding_side: left}` is AutoProcessor of the model's path with those keys."""
    import yaml
    from vlm_testing import tiny_processor

    from automodel.errors import ConfigError

    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    tiny_processor().save_pretrained(model_dir)
    path = make_config()
    data = yaml.safe_load(path.read_text())
    data["processor"] = {"padding_side": "left"}
    data["model"] = {"_target_": "automodel_vlm.AutoModelForImageTextToText.from_pretrained",
                     "pretrained_model_name_or_path": str(model_dir)}
    path.write_text(yaml.safe_dump(data))
    recipe = train_inprocess(path, setup_only=True)
    assert type(recipe.processor).__name__ == "LlavaProcessor"
    assert recipe.processor.tokenizer.padding_side == "left" != tiny_processor().tokenizer.padding_side
    data["model"] = {"_target_": "automodel_vlm.AutoModelForImageTextToText.from_config", "config": str(LLAVA_CONFIG)}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"^invalid configuration: processor: missing: the model is not loaded"):
        train_inprocess(path, setup_only=True)


def test_model_from_config_with_sub_config_overrides(tmp_path):
    model = tiny_model(text_config={"num_hidden_layers": 1}, vision_config={"num_hidden_layers": 1})
    assert model.config.text_config.num_hidden_layers == 1 and model.config.vision_config.num_hidden_layers == 1
    assert model.config.text_config.hidden_size == 64 and model.config.vision_config.patch_size == 8
    vision = json.loads(LLAVA_CONFIG.read_text())["vision_config"] | {"hidden_size": 16, "intermediate_size": 32}
    (tmp_path / "vision.json").write_text(json.dumps(vision))
    assert tiny_model(vision_config=str(tmp_path / "vision.json")).config.vision_config.hidden_size == 16
    assert torch.equal(tiny_model().lm_head.weight, tiny_model().lm_head.weight)  # seed: reproducible
    # a folder holding only config.json is a fresh model of that architecture
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.json").write_text(LLAVA_CONFIG.read_text())
    fresh = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "fresh"), seed=0)
    assert torch.equal(fresh.lm_head.weight, tiny_model().lm_head.weight)
    with pytest.raises(AutomodelError, match=r"^model.text_config: needs a 'model_type'"):
        AutoModelForImageTextToText.from_config({"model_type": "llava", "text_config": {"hidden_size": 8}})


@pytest.mark.smoke
def test_seeded_model_has_the_initial_distributions_of_transformers_own_build():
    """Module-by-module initialisation follows the model's _init_weights, parents included: CLIP sets its patch
    convolution and attention projections from the parent module (at transformers 5.0 only there)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(LLAVA_CONFIG.parent))
    torch.manual_seed(0)
    reference = dict(transformers.AutoModelForImageTextToText.from_config(config).named_parameters())
    for name, param in tiny_model().named_parameters():
        ours, theirs = param.detach(), reference[name].detach()
        if theirs.std() == 0:  # constants: norms' ones, zero biases
            assert torch.equal(ours, theirs), name
            continue
        low, high = (0.8, 1.25) if ours.numel() >= 256 else (0.5, 2.0)  # a small tensor's std is a rough estimate
        assert low < ours.std() / theirs.std() < high, (name, float(ours.std()), float(theirs.std()))


# ---- plugin and CLI ------------------------------------------------------------------------------------------

def cli(*args, capsys) -> tuple[int, str, str]:
    from automodel.cli.main import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_route_example_and_stages_are_registered(capsys, tmp_path):
    from automodel.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    route = manager.routes.get("finetune", "vlm")
    assert route.recipe == "automodel_vlm.recipe.FinetuneRecipeForVLM" and route.examples == ["vlm/tiny_llava"]
    assert {("peft", "vlm_lora"), ("freeze", "vlm")} <= set(manager.stages.stages)
    code, out, _ = cli("recipes", capsys=capsys)
    assert code == 0 and "finetune vlm" in out and "vlm/tiny_llava" in out
    code, _, _ = cli("cp", "vlm/tiny_llava", tmp_path / "mine.yaml", capsys=capsys)
    assert code == 0 and (tmp_path / "mine.yaml").read_text() == EXAMPLE.read_text()


def test_dry_run_plan_and_validation_errors(capsys):
    code, out, err = cli("finetune", "vision-language", "-c", "vlm/tiny_llava", "--dry-run", "--peft.dim", "4",
                         capsys=capsys)
    assert code == 0, err
    assert "pipeline peft: vlm_lora" in out + err and "pipeline freeze: vlm" in out + err
    code, out, err = cli("validate", "-c", EXAMPLE, "--freeze.vision_towr", "false", capsys=capsys)
    assert code != 0 and "freeze.vision_towr" in out + err and "vision_tower" in out + err


def test_activation_checkpointing_wraps_the_language_model_layers_not_the_vision_towers(make_config):
    """The tiny Llava's vision tower has as many layers as its language model and comes first: the blocks
    checkpointed (and compiled one by one) are the language model's, the towers the recipe names are skipped."""
    config = make_config(distributed={"activation_checkpointing": True})
    recipe = train_inprocess(config, setup_only=True)
    wrapped = [n for n, m in recipe.model.named_modules() if type(m).__name__ == "CheckpointWrapper"]
    assert wrapped and all(".language_model.layers." in n for n in wrapped), wrapped
