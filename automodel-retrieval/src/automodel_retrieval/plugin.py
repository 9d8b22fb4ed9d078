"""The retrieval domain's registrations (exactly what a third-party plugin would write). Import-light."""

from automodel import hookimpl

_BI = "automodel_retrieval.recipe.BiEncoderRecipe"
_CROSS = "automodel_retrieval.recipe.CrossEncoderRecipe"
_MINE = "automodel_retrieval.mining.MineHardNegativesRecipe"
_DISTILL_RECIPE = "automodel_retrieval.distill.EmbeddingDistillRecipe"
_LLM_DATA = "nemo_automodel.components.datasets.llm"
_UPSTREAM = {
    "nemo_automodel.NeMoAutoModelBiEncoder.from_pretrained": "bi_encoder_from_pretrained",
    "nemo_automodel._transformers.auto_model.NeMoAutoModelBiEncoder.from_pretrained": "bi_encoder_from_pretrained",
    "nemo_automodel.NeMoAutoModelCrossEncoder.from_pretrained": "cross_encoder_from_pretrained",
    "nemo_automodel._transformers.auto_model.NeMoAutoModelCrossEncoder.from_pretrained":
        "cross_encoder_from_pretrained",
    "nemo_automodel.NeMoAutoTokenizer.from_pretrained": "tokenizer_from_pretrained",
    "nemo_automodel._transformers.auto_tokenizer.NeMoAutoTokenizer.from_pretrained": "tokenizer_from_pretrained",
    f"{_LLM_DATA}.retrieval_dataset.RetrievalDatasetConfig": "retrieval_dataset",
    # the function behind RetrievalDatasetConfig, named by upstream's legacy dataloader.dataset (legacy_data.py)
    f"{_LLM_DATA}.make_retrieval_dataset": "retrieval_dataset",
    f"{_LLM_DATA}.retrieval_dataset.make_retrieval_dataset": "retrieval_dataset",
    f"{_LLM_DATA}.BiEncoderCollator": "UpstreamBiEncoderCollator",
    f"{_LLM_DATA}.retrieval_collator.BiEncoderCollator": "UpstreamBiEncoderCollator",
    f"{_LLM_DATA}.CrossEncoderCollator": "UpstreamCrossEncoderCollator",
    f"{_LLM_DATA}.retrieval_collator.CrossEncoderCollator": "UpstreamCrossEncoderCollator",
}
# Upstream's embedding-distillation names (its model classes live in a private module, _transformers.retrieval;
# a config names them, these aliases lead them to our public callables in automodel_retrieval.upstream_distill).
_UPSTREAM_DISTILL = {
    "nemo_automodel._transformers.retrieval.RetrieverStudentWithProjection.build": "student_from_pretrained",
    "nemo_automodel._transformers.retrieval.RetrieverTeacherEmbeddingEncoder.build": "teacher_from_pretrained",
    f"{_LLM_DATA}.BiEncoderDistillCollator": "UpstreamBiEncoderDistillCollator",
    f"{_LLM_DATA}.retrieval_distill_collator.BiEncoderDistillCollator": "UpstreamBiEncoderDistillCollator",
}
_LOSSES = {"nemo_automodel.components.loss.embedding_distill.EmbeddingDistillLoss": "EmbeddingDistillLoss",
           "nemo_automodel.components.loss.embedding_distill.EmbeddingMSELoss": "EmbeddingMSELoss",
           "nemo_automodel.components.loss.infonce.InfoNCEDistillLoss": "InfoNCEDistillLoss"}
_MULTIMODAL = ("image-and-text retrieval runs upstream's own LlamaNemotronVL model (model_type llama_nemotron_vl, "
               "nvidia/llama-nemotron-embed-vl-*), which exists only as upstream's and the checkpoint's own code: "
               "transformers has no class for it, and automodel trains transformers' classes without running a "
               "checkpoint's code; the retrieval recipes here embed text")
_UNSUPPORTED = {
    f"{_LLM_DATA}.ProcessorMethodCollator": _MULTIMODAL + " with a tokenizer (BiEncoderCollator)",
    "nemo_automodel.components.models.llama_nemotron_vl.processor.LlamaNemotronVLProcessor.from_pretrained":
        _MULTIMODAL + ": give a text tokenizer (NeMoAutoTokenizer.from_pretrained or "
        "transformers.AutoTokenizer.from_pretrained)",
}
_UPSTREAM_RECIPES = {"TrainBiEncoderRecipe": ("finetune", "retrieval"),
                     "TrainCrossEncoderRecipe": ("finetune", "cross-encoder"),
                     "MineHardNegativesRecipe": ("mine", "retrieval"),
                     "EmbeddingDistillRecipe": ("kd", "retrieval")}
_UPSTREAM_MODULES = {"TrainBiEncoderRecipe": "train_bi_encoder", "TrainCrossEncoderRecipe": "train_cross_encoder",
                     "MineHardNegativesRecipe": "mine_hard_negatives", "EmbeddingDistillRecipe": "distill_bi_encoder"}


@hookimpl
def automodel_register_routes(routes) -> None:
    routes.add("finetune", "retrieval", recipe=_BI, examples=["retrieval/tiny_bi_encoder"],
               help="Fine-tune a bi-encoder (query and document encoders) with contrastive InfoNCE")
    routes.add("finetune", "cross-encoder", recipe=_CROSS, examples=["retrieval/tiny_cross_encoder"],
               help="Fine-tune a cross-encoder reranker (one logit per query-document pair)")
    routes.add("mine", "retrieval", recipe=_MINE, examples=["retrieval/tiny_mine"],
               help="Mine hard negatives for bi-encoder training with a trained bi-encoder")
    routes.add("kd", "retrieval", recipe=_DISTILL_RECIPE, examples=["retrieval/tiny_distill"],
               help="Distill a bi-encoder student from a frozen teacher encoder's embeddings")


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
    # Upstream (NeMo AutoModel) names, on this package's models, data and collators (automodel_retrieval.upstream).
    for name, ours in _UPSTREAM.items():
        aliases.target(name, f"automodel_retrieval.upstream.{ours}")
    for name, ours in _UPSTREAM_DISTILL.items():
        aliases.target(name, f"automodel_retrieval.upstream_distill.{ours}")
    for name, ours in _LOSSES.items():
        aliases.target(name, f"automodel_retrieval.distill_losses.{ours}")
    for name in ("EmbeddingDistillLoss", "EmbeddingMSELoss", "InfoNCEDistillLoss"):
        aliases.target(name, f"automodel_retrieval.distill_losses.{name}")
    for name, reason in _UNSUPPORTED.items():
        aliases.unsupported(name, reason)


@hookimpl
def automodel_allowed_targets() -> list[str]:
    return ["automodel_retrieval"]
