"""Upstream NeMo AutoModel's recipe class names (a config's ``recipe:``, bare or dotted) select our routes; a name
we have no recipe for is refused with the installed recipes listed (issue 20). Every name here is one upstream's
examples/ folder gives in ``recipe:``; each domain registers its own through ``aliases.recipe``."""

from __future__ import annotations

import pytest

from automodel.cli.execute import import_recipe, recipe_from_config
from automodel.config import TargetError
from automodel.errors import ConfigError
from automodel.plugins.manager import get_plugin_manager

UP = "nemo_automodel.recipes"
SELECTS = {
    "TrainFinetuneRecipeForNextTokenPrediction": "finetune llm",
    f"{UP}.llm.train_ft.TrainFinetuneRecipeForNextTokenPrediction": "finetune llm",
    "BenchmarkingRecipeForNextTokenPrediction": "benchmark llm",
    f"{UP}.llm.benchmark.BenchmarkingRecipeForNextTokenPrediction": "benchmark llm",
    "KnowledgeDistillationRecipeForNextTokenPrediction": "kd llm",
    f"{UP}.llm.kd.KnowledgeDistillationRecipeForNextTokenPrediction": "kd llm",
    "TrainFinetuneRecipeForSequenceClassification": "finetune seq-cls",
    f"{UP}.llm.train_seq_cls.TrainFinetuneRecipeForSequenceClassification": "finetune seq-cls",
    "FinetuneRecipeForVLM": "finetune vlm",
    f"{UP}.vlm.finetune.FinetuneRecipeForVLM": "finetune vlm",
    "TrainBiEncoderRecipe": "finetune retrieval",
    f"{UP}.retrieval.train_bi_encoder.TrainBiEncoderRecipe": "finetune retrieval",
    "TrainCrossEncoderRecipe": "finetune cross-encoder",
    f"{UP}.retrieval.train_cross_encoder.TrainCrossEncoderRecipe": "finetune cross-encoder",
    "MineHardNegativesRecipe": "mine retrieval",
    "KnowledgeDistillationRecipeForVLM": "kd vlm",
    f"{UP}.vlm.kd.KnowledgeDistillationRecipeForVLM": "kd vlm",
    "EmbeddingDistillRecipe": "kd retrieval",
    f"{UP}.retrieval.distill_bi_encoder.EmbeddingDistillRecipe": "kd retrieval",
    "TrainDiffusionRecipe": "finetune diffusion",
    f"{UP}.diffusion.train.TrainDiffusionRecipe": "finetune diffusion",
    "DiffusionLMSFTRecipe": "finetune dllm",
    f"{UP}.dllm.train_ft.DiffusionLMSFTRecipe": "finetune dllm",
    "DiffusionGemmaSFTRecipe": "finetune dllm",
    "TrainEagle3Recipe": "finetune eagle3",
    f"{UP}.llm.train_eagle3.TrainEagle3Recipe": "finetune eagle3",
    "TrainEagle1Recipe": "finetune eagle",
    f"{UP}.llm.train_eagle1.TrainEagle1Recipe": "finetune eagle",
    "TrainEagle2Recipe": "finetune eagle",
    f"{UP}.llm.train_eagle2.TrainEagle2Recipe": "finetune eagle",
    "TrainDFlashRecipe": "finetune dflash",
    f"{UP}.llm.train_dflash.TrainDFlashRecipe": "finetune dflash",
    "TrainJetSpecRecipe": "finetune jetspec",
    f"{UP}.llm.train_jetspec.TrainJetSpecRecipe": "finetune jetspec",
    "TrainDominoRecipe": "finetune domino",
    f"{UP}.llm.train_domino.TrainDominoRecipe": "finetune domino",
    "TrainDFlash2Recipe": "finetune dflash2",
    f"{UP}.llm.train_dflash2.TrainDFlash2Recipe": "finetune dflash2",
    "TrainDSparkRecipe": "finetune dspark",
    f"{UP}.llm.train_dspark.TrainDSparkRecipe": "finetune dspark",
}
# Upstream recipes with no counterpart here (speculative decoding drafters, multimodal), with words of the reason.
NOT_HERE = {"TrainVispecStage1Recipe": "speculative-decoding",
            f"{UP}.llm.train_vispec.TrainVispecRecipe": "speculative-decoding",
            "FinetuneRecipeForMultimodal": "BAGEL", "PretrainRecipeForMultimodal": "BAGEL"}


@pytest.mark.parametrize("name,route", SELECTS.items())
def test_upstream_recipe_name_selects_its_route(name, route):
    manager = get_plugin_manager()
    expected = import_recipe(manager.routes.get(*route.split(" ")).recipe)
    assert manager.resolver().resolve_recipe(name) is expected
    for form in (name, {"_target_": name}):
        assert recipe_from_config({"recipe": form}, manager) is expected


@pytest.mark.parametrize("name,reason", NOT_HERE.items())
def test_upstream_recipe_we_do_not_have_is_refused_listing_the_routes(name, reason):
    manager = get_plugin_manager()
    with pytest.raises(TargetError) as info:
        manager.resolver().resolve_recipe(name)
    message = str(info.value)
    assert f"'{name}' names no recipe installed here" in message and reason in message
    for command, domain in manager.routes.routes:
        assert f"{command} {domain}" in message
    with pytest.raises(ConfigError) as err:
        recipe_from_config({"recipe": name}, manager)
    assert err.value.issues[0].key == "recipe" and "names no recipe installed here" in err.value.issues[0].message


def test_upstream_sections_and_targets_of_recipes_not_built_here_are_refused_with_the_reason(tmp_path):
    """The section of upstream's speculative-decoding recipes, a speech data set and collator, and the VLM THD
    collator each say why (not "unknown section" / "not a registered target")."""
    from automodel.cli.examples import find_example
    from automodel.config import load_yaml_file
    from automodel.testing import load_config, write_yaml

    llm = load_yaml_file(find_example("llm/tiny_squad", get_plugin_manager()))
    with pytest.raises(ConfigError) as err:
        load_config(write_yaml(tmp_path / "llm.yaml", {**llm, "recipe_args": {"ttt_steps": 4}}))
    message = {i.key: i.message for i in err.value.issues}["recipe_args"]
    assert "automodel finetune eagle," in message and "finetune eagle3" in message

    vlm = load_yaml_file(find_example("vlm/tiny_llava", get_plugin_manager()))
    audio = "nemo_automodel.components.datasets.audio"
    vlm["dataset"] = {"_target_": f"{audio}.datasets.make_hf_audio_asr_dataset"}
    vlm["dataloader"] = {**vlm.get("dataloader", {}), "collate_fn": {"_target_": f"{audio}.collate_fns."
                                                                      "qwen3_omni_asr_collate_fn"}}
    vlm["validation_dataloader"] = {"collate_fn": {
        "_target_": "nemo_automodel.components.datasets.utils.packed_sequence_thd_collater_vlm"}}
    with pytest.raises(ConfigError) as err:
        load_config(write_yaml(tmp_path / "vlm.yaml", vlm), route=("finetune", "vlm"))
    issues = {i.key: i.message for i in err.value.issues}
    assert "speech recognition fine-tuning" in issues["dataset._target_"]
    assert "speech recognition fine-tuning" in issues["dataloader.collate_fn._target_"]
    assert "Transformer Engine" in issues["validation_dataloader.collate_fn._target_"]
