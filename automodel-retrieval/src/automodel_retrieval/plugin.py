"""The retrieval domain's registrations (exactly what a third-party plugin would write). Import-light."""

from automodel import hookimpl

_BI = "automodel_retrieval.recipe.BiEncoderRecipe"
_CROSS = "automodel_retrieval.recipe.CrossEncoderRecipe"
_MINE = "automodel_retrieval.mining.MineHardNegativesRecipe"
_UPSTREAM_RECIPES = {"TrainBiEncoderRecipe": ("finetune", "retrieval"),
                     "TrainCrossEncoderRecipe": ("finetune", "cross-encoder"),
                     "MineHardNegativesRecipe": ("mine", "retrieval")}
_UPSTREAM_MODULES = {"TrainBiEncoderRecipe": "train_bi_encoder", "TrainCrossEncoderRecipe": "train_cross_encoder",
                     "MineHardNegativesRecipe": "mine_hard_negatives"}


@hookimpl
def automodel_register_routes(routes) -> None:
    routes.add("finetune", "retrieval", recipe=_BI, examples=["retrieval/tiny_bi_encoder"],
               help="Fine-tune a bi-encoder (query and document encoders) with contrastive InfoNCE")
    routes.add("finetune", "cross-encoder", recipe=_CROSS, examples=["retrieval/tiny_cross_encoder"],
               help="Fine-tune a cross-encoder reranker (one logit per query-document pair)")
    routes.add("mine", "retrieval", recipe=_MINE, examples=["retrieval/tiny_mine"],
               help="Mine hard negatives for bi-encoder training with a trained bi-encoder")


@hookimpl
def automodel_register_aliases(aliases) -> None:
    aliases.domain("bi-encoder", "retrieval")
    # Upstream's recipe class names (a config's `recipe:`), by bare name and by path.
    for name, route in _UPSTREAM_RECIPES.items():
        aliases.recipe(name, *route)
        aliases.recipe(f"nemo_automodel.recipes.retrieval.{_UPSTREAM_MODULES[name]}.{name}", *route)
    aliases.target("BiEncoder", "automodel_retrieval.models.BiEncoder.from_pretrained")
    aliases.target("CrossEncoder", "automodel_retrieval.models.CrossEncoder.from_pretrained")
    aliases.target("RetrievalDataset", "automodel_retrieval.data.RetrievalDataset")
    aliases.target("InfoNCELoss", "automodel_retrieval.losses.InfoNCELoss")
    aliases.target("ListwiseCrossEntropy", "automodel_retrieval.losses.ListwiseCrossEntropy")


@hookimpl
def automodel_allowed_targets() -> list[str]:
    return ["automodel_retrieval"]
