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
}
# Upstream recipes with no counterpart here (speculative decoding drafters, multimodal).
NOT_HERE = ["TrainEagle3Recipe", "TrainDFlashRecipe",
            "FinetuneRecipeForMultimodal", "PretrainRecipeForMultimodal"]


@pytest.mark.parametrize("name,route", SELECTS.items())
def test_upstream_recipe_name_selects_its_route(name, route):
    manager = get_plugin_manager()
    expected = import_recipe(manager.routes.get(*route.split(" ")).recipe)
    assert manager.resolver().resolve_recipe(name) is expected
    for form in (name, {"_target_": name}):
        assert recipe_from_config({"recipe": form}, manager) is expected


@pytest.mark.parametrize("name", NOT_HERE)
def test_upstream_recipe_we_do_not_have_is_refused_listing_the_routes(name):
    manager = get_plugin_manager()
    with pytest.raises(TargetError) as info:
        manager.resolver().resolve_recipe(name)
    message = str(info.value)
    assert f"'{name}' names no recipe installed here" in message
    for command, domain in manager.routes.routes:
        assert f"{command} {domain}" in message
    with pytest.raises(ConfigError) as err:
        recipe_from_config({"recipe": name}, manager)
    assert err.value.issues[0].key == "recipe" and "names no recipe installed here" in err.value.issues[0].message
