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
_NEMOTRON_PARSE = ("Nemotron-Parse (nvidia/NVIDIA-Nemotron-Parse-*, an encoder-decoder document parser) exists only "
                   "as the checkpoint's own remote code: transformers has no Nemotron-Parse model or processor class, "
                   "and automodel trains transformers' classes without running a checkpoint's code; fine-tune a "
                   "transformers VLM with default_collate_fn and MaskedCrossEntropy")
_SPEECH = ("speech recognition fine-tuning (audio clips into Qwen2.5-Omni / Qwen3-Omni, upstream's audio_finetune/) "
           "is not built here: the VLM recipe feeds a model images and text only (no audio features reach it), and "
           "decoding the clips needs torchcodec (datasets' Audio column), which this installation lacks")
_BAGEL = ("upstream's Bagel recipes train ByteDance's BAGEL (a unified understanding-and-generation model with its "
          "own model code, EMA weights and image-generation loss), which transformers and this build do not have; "
          "fine-tune a transformers vision-language model with recipe FinetuneRecipeForVLM (automodel finetune vlm)")
# Upstream names nothing here implements, each with the reason and what to use instead.
UNSUPPORTED = {
    f"{_DATASETS}.make_meta_dataset": "upstream's meta-JSON data mixtures are not implemented; " + _OURS,
    "nemo_automodel.components.datasets.audio.datasets.make_cv17_dataset":
        "CommonVoice rows are speech: the VLM recipe feeds a model images and text only (no audio features reach "
        "it), and decoding the clips needs torchcodec (datasets' Audio column), which this installation lacks; "
        "use an image-text data set (" + _OURS.removeprefix("use ") + ")",
    f"{_COLLATE}.phi4_mm_collate_fn": "Phi-4-multimodal's collation feeds speech (CommonVoice clips) to the model: "
                                      "the VLM recipe passes images and text only (no audio features reach a "
                                      "model), and decoding the clips needs torchcodec (datasets' Audio column), "
                                      "which this installation lacks; train an image-text model with "
                                      "default_collate_fn instead",
    f"{_COLLATE}.kimi_vl_collate_fn": "Kimi-VL (model_type kimi_vl, moonshotai/Kimi-VL-A3B-*) exists only as the "
                                      "checkpoint's own remote code: transformers has no Kimi-VL model or processor "
                                      "class, and automodel trains transformers' classes without running a "
                                      "checkpoint's code; fine-tune Kimi-K2.5 (transformers' kimi_k25, "
                                      "kimi_k25_vl_collate_fn) or another transformers VLM with default_collate_fn",
    f"{_COLLATE}.nemotron_parse_collate_fn": _NEMOTRON_PARSE,
    f"{_MODELS}.nemotron_parse.nemotron_parse_loss.NemotronParseLoss": _NEMOTRON_PARSE,
    "nemo_automodel.components.datasets.utils.packed_sequence_thd_collater_vlm":
        "THD batches (sequences concatenated, qkv_format thd) feed Transformer Engine's attention kernels, which need "
        "a CUDA GPU and Transformer Engine; remove collate_fn (default_collate_fn pads each batch; packed_sequence: "
        "packs samples for Hugging Face attention)",
    **{f"nemo_automodel.components.datasets.audio.{name}": _SPEECH for name in (
        "datasets.make_hf_audio_asr_dataset", "multi_en.make_multi_en_asr_dataset",
        "collate_fns.qwen2_5_omni_asr_collate_fn", "collate_fns.qwen3_omni_asr_collate_fn")},
    # upstream's Bagel recipes (multimodal_finetune/, multimodal_pretrain/): as a config's recipe: name and path
    **{name: _BAGEL for name in (
        "FinetuneRecipeForMultimodal", "PretrainRecipeForMultimodal",
        "nemo_automodel.recipes.multimodal.finetune.FinetuneRecipeForMultimodal",
        "nemo_automodel.recipes.multimodal.pretrain.PretrainRecipeForMultimodal")},
}


@hookimpl
def automodel_register_routes(routes) -> None:
    routes.add("finetune", "vlm", recipe=_RECIPE, help="Fine-tune a vision-language (image-text-to-text) model",
               examples=["vlm/tiny_llava"])
    routes.add("kd", "vlm", recipe="automodel_vlm.kd.KnowledgeDistillationRecipeForVLM",
               help="Distil a frozen vision-language teacher_model into the student model")


@hookimpl
def automodel_register_aliases(aliases) -> None:
    aliases.domain("vision-language", "vlm")
    aliases.recipe("FinetuneRecipeForVLM", "finetune", "vlm")  # upstream's recipe class, by name and by path
    aliases.recipe("nemo_automodel.recipes.vlm.finetune.FinetuneRecipeForVLM", "finetune", "vlm")
    aliases.recipe("KnowledgeDistillationRecipeForVLM", "kd", "vlm")
    aliases.recipe("nemo_automodel.recipes.vlm.kd.KnowledgeDistillationRecipeForVLM", "kd", "vlm")
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
    # Kimi K2.5's: transformers' Kimi_K25Processor expands the image tokens itself; a row cut inside an image loses
    # that row's images, as upstream's collate does (automodel_vlm.datasets.kimi_k25)
    aliases.target(f"{_COLLATE}.kimi_k25_vl_collate_fn", "automodel_vlm.datasets.kimi_k25.KimiK25Collator")
    # upstream's processor loader: AutoProcessor through load_processor (errors that name the key; a Kimi K2.5
    # checkpoint, whose hub processor is remote code, loads transformers' Kimi_K25Processor; without torchvision
    # the Pillow twins of the omni families' and Qwen-VL video processors; upstream's own processor.video_processor)
    aliases.target("transformers.AutoProcessor.from_pretrained", "automodel_vlm.processor.load_processor")
    # Gemma 4's: the same collation with the thinking-channel prefix inserted after each model turn, unlabelled;
    # upstream's hook (batch, processor) -> batch itself; as packed_sequence.post_tokenize_hook_fn, packing tokenizes
    # each sample with Gemma4PrefixCollator (VLMPackedSequenceConfig.sample_collator)
    aliases.target(f"{_COLLATE}.gemma4_prefix_collate_fn", "automodel_vlm.datasets.gemma4.Gemma4PrefixCollator")
    aliases.target(f"{_COLLATE}.gemma4_inject_thinking_prefix", "automodel_vlm.datasets.gemma4.inject_thinking_prefix")
    # the omni families on images and text (automodel_vlm.omni): Qwen3-Omni's thinker, Nemotron-H Omni; their
    # collators refuse audio and video rows when a batch is made
    aliases.target("nemo_automodel.NeMoAutoModelForMultimodalLM.from_pretrained",
                   "automodel_vlm.omni.AutoModelForMultimodalLM.from_pretrained")
    aliases.target("nemo_automodel.NeMoAutoModelForMultimodalLM.from_config",
                   "automodel_vlm.omni.AutoModelForMultimodalLM.from_config")
    aliases.target(f"{_COLLATE}.qwen3_omni_collate_fn", "automodel_vlm.datasets.omni.Qwen3OmniCollator")
    aliases.target(f"{_COLLATE}.nemotron_omni_collate_fn", "automodel_vlm.datasets.omni.NemotronOmniCollator")
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
