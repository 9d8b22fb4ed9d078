"""The VLM domain's registrations (what a third-party plugin would write). Import-light: no torch."""

from automodel import hookimpl

_RECIPE = "automodel_vlm.recipe.FinetuneRecipeForVLM"
_DATASETS = "nemo_automodel.components.datasets.vlm.datasets"
_COLLATE = "nemo_automodel.components.datasets.vlm.collate_fns"
_OURS = ("use ImageTextChatDataset (a JSONL/JSON/parquet file or hub set of {messages, image} rows) or one of "
         "make_medpix_dataset, make_rdr_dataset, make_cord_v2_dataset, make_shopify_product_catalogue_dataset, "
         "make_tulu3_dataset (text-only chat)")
_MODELS = "nemo_automodel.components.models"
# upstream's own processor builders of the families transformers now ships: transformers' processor class of each
FAMILY_PROCESSORS = {
    f"{_MODELS}.inkling.processing.build_inkling_processor": "inkling_processor",
    f"{_MODELS}.minimax_m3_vl.processing.build_minimax_m3_vl_processor": "minimax_m3_vl_processor",
    f"{_MODELS}.step3p7.processing_step3.Step3VLProcessor.from_pretrained": "step3p7_processor",
}
_GENERIC_COLLATE = ("use default_collate_fn (the processor's chat template renders the conversation; labels on the "
                    "assistant turns), which serves processors that follow transformers' conventions")
# Upstream names nothing here implements, each with the reason and what to use instead.
UNSUPPORTED = {
    f"{_DATASETS}.make_meta_dataset": "upstream's meta-JSON data mixtures are not implemented; " + _OURS,
    "nemo_automodel.components.datasets.audio.datasets.make_cv17_dataset": "audio data is not supported by the VLM "
                                                                           "recipe (images only)",
    f"{_COLLATE}.nemotron_omni_collate_fn": "Nemotron Omni's audio/video collation is not implemented; "
                                            + _GENERIC_COLLATE,
    f"{_COLLATE}.qwen3_omni_collate_fn": "Qwen3-Omni's audio/video collation is not implemented; " + _GENERIC_COLLATE,
    f"{_COLLATE}.phi4_mm_collate_fn": "Phi-4-multimodal's (remote-code processor, audio) collation is not "
                                      "implemented; " + _GENERIC_COLLATE,
    f"{_COLLATE}.kimi_vl_collate_fn": "Kimi-VL's remote-code processor collation is not implemented; "
                                      + _GENERIC_COLLATE,
    f"{_COLLATE}.kimi_k25_vl_collate_fn": "Kimi-K2.5-VL's remote-code processor collation is not implemented; "
                                          + _GENERIC_COLLATE,
    f"{_COLLATE}.nemotron_parse_collate_fn": "Nemotron-Parse's collation is not implemented; " + _GENERIC_COLLATE,
    "nemo_automodel.NeMoAutoModelForMultimodalLM.from_pretrained":
        "audio-and-video (omni) models are not supported by the VLM recipe (images and text only); use "
        "NeMoAutoModelForImageTextToText.from_pretrained for an image-text-to-text model",
}


@hookimpl
def automodel_register_routes(routes) -> None:
    routes.add("finetune", "vlm", recipe=_RECIPE, help="Fine-tune a vision-language (image-text-to-text) model",
               examples=["vlm/tiny_llava"])


@hookimpl
def automodel_register_aliases(aliases) -> None:
    aliases.domain("vision-language", "vlm")
    aliases.recipe("FinetuneRecipeForVLM", "finetune", "vlm")  # upstream's recipe class, by name and by path
    aliases.recipe("nemo_automodel.recipes.vlm.finetune.FinetuneRecipeForVLM", "finetune", "vlm")
    aliases.target("AutoModelForImageTextToText", "automodel_vlm.AutoModelForImageTextToText.from_pretrained")
    aliases.target("ImageTextChatDataset", "automodel_vlm.datasets.ImageTextChatDataset")
    # Upstream (NeMo AutoModel) public paths, so its users' configs run unchanged.
    aliases.target("nemo_automodel.NeMoAutoModelForImageTextToText.from_pretrained",
                   "automodel_vlm.AutoModelForImageTextToText.from_pretrained")
    aliases.target("nemo_automodel.NeMoAutoModelForImageTextToText.from_config",
                   "automodel_vlm.AutoModelForImageTextToText.from_config")
    # Gemma 4 trained jointly with its drafter (transformers' Gemma4AssistantForCausalLM): automodel_vlm.drafter
    aliases.target(f"{_MODELS}.gemma4_drafter.composite.Gemma4WithDrafter.from_pretrained",
                   "automodel_vlm.drafter.Gemma4WithDrafter.from_pretrained")
    # upstream's fused loss for Gemma 4's tied, vocabulary-sharded head under tensor parallelism: the core's
    # LinearCrossEntropy, which is vocabulary-parallel there (same keys: logit_softcapping, reduction, chunk_len)
    aliases.target(f"{_MODELS}.gemma4_moe.loss.Gemma4TensorParallelFusedLinearCrossEntropy",
                   "automodel.training.linear_ce.LinearCrossEntropy")
    for name in ("make_medpix_dataset", "make_rdr_dataset", "make_cord_v2_dataset",
                 "make_shopify_product_catalogue_dataset", "make_tulu3_dataset",
                 "make_tulu3_magicoder_text_mix_dataset"):
        aliases.target(f"{_DATASETS}.{name}", f"automodel_vlm.datasets.{name}")
    aliases.target("nemo_automodel.components.datasets.vlm.mock.build_mock_vlm_dataset",
                   "automodel_vlm.datasets.MockVLMDataset")
    # upstream's collate functions, called with the samples and the processor: here the collator class the core
    # builds once with the recipe's processor and the node's keys (max_length, drop_overlong)
    for name in ("default_collate_fn", "qwen2_5_collate_fn", "llava_onevision_collate_fn"):
        aliases.target(f"{_COLLATE}.{name}", "automodel_vlm.datasets.collate.VLMCollator")
    # Gemma 4's: the same collation with the thinking-channel prefix inserted after each model turn, unlabelled;
    # upstream's hook (batch, processor) -> batch itself; as packed_sequence.post_tokenize_hook_fn, packing tokenizes
    # each sample with Gemma4PrefixCollator (VLMPackedSequenceConfig.sample_collator)
    aliases.target(f"{_COLLATE}.gemma4_prefix_collate_fn", "automodel_vlm.datasets.gemma4.Gemma4PrefixCollator")
    aliases.target(f"{_COLLATE}.gemma4_inject_thinking_prefix", "automodel_vlm.datasets.gemma4.inject_thinking_prefix")
    # upstream's processor target: AutoProcessor through load_processor (a pad token, the chat template, errors that
    # name the key; a Pillow video processor without torchvision, and upstream's own processor.video_processor)
    aliases.target("transformers.AutoProcessor.from_pretrained", "automodel_vlm.processor.load_processor")
    # upstream's processor.video_processor: transformers' class, or our Pillow twin of it without torchvision
    aliases.target("transformers.models.qwen3_vl.video_processing_qwen3_vl.Qwen3VLVideoProcessor.from_pretrained",
                   "automodel_vlm.video_processors.qwen3_vl_video_processor")
    aliases.target("transformers.models.qwen2_vl.video_processing_qwen2_vl.Qwen2VLVideoProcessor.from_pretrained",
                   "automodel_vlm.video_processors.qwen2_vl_video_processor")
    for name, builder in FAMILY_PROCESSORS.items():
        aliases.target(name, f"automodel_vlm.family_processors.{builder}")
    for name, reason in UNSUPPORTED.items():
        aliases.unsupported(name, reason)


@hookimpl
def automodel_register_stages(stages) -> None:
    stages.add("peft", "vlm_lora", "automodel_vlm.peft.apply_lora_to_language_model")
    stages.add("freeze", "vlm", "automodel_vlm.freeze.freeze_vlm")


@hookimpl
def automodel_allowed_targets() -> list[str]:
    return [
        "automodel_vlm",  # its own package
        "transformers.AutoProcessor",  # processor: AutoProcessor.from_pretrained (upstream configs)
        "peft.LoraConfig",  # peft: used as given
    ]
