"""The LLM domain's registrations (exactly what a third-party plugin would write). Import-light."""

from automodel import hookimpl

_RECIPE = "automodel_llm.recipe.FinetuneRecipeForNextTokenPrediction"
_UPSTREAM = "nemo_automodel.recipes.llm"
_UPSTREAM_RECIPES = {
    ("finetune", "llm"): ("TrainFinetuneRecipeForNextTokenPrediction",
                          f"{_UPSTREAM}.train_ft.TrainFinetuneRecipeForNextTokenPrediction"),
    ("kd", "llm"): ("KnowledgeDistillationRecipeForNextTokenPrediction",
                    f"{_UPSTREAM}.kd.KnowledgeDistillationRecipeForNextTokenPrediction"),
    ("benchmark", "llm"): ("BenchmarkingRecipeForNextTokenPrediction",
                           f"{_UPSTREAM}.benchmark.BenchmarkingRecipeForNextTokenPrediction"),
    ("finetune", "seq-cls"): ("TrainFinetuneRecipeForSequenceClassification",
                              f"{_UPSTREAM}.train_seq_cls.TrainFinetuneRecipeForSequenceClassification"),
    ("finetune", "eagle3"): ("TrainEagle3Recipe", f"{_UPSTREAM}.train_eagle3.TrainEagle3Recipe"),
    ("finetune", "dflash"): ("TrainDFlashRecipe", f"{_UPSTREAM}.train_dflash.TrainDFlashRecipe"),
    ("finetune", "jetspec"): ("TrainJetSpecRecipe", f"{_UPSTREAM}.train_jetspec.TrainJetSpecRecipe"),
    ("finetune", "domino"): ("TrainDominoRecipe", f"{_UPSTREAM}.train_domino.TrainDominoRecipe"),
    ("finetune", "dflash2"): ("TrainDFlash2Recipe", f"{_UPSTREAM}.train_dflash2.TrainDFlash2Recipe"),
    ("finetune", "dspark"): ("TrainDSparkRecipe", f"{_UPSTREAM}.train_dspark.TrainDSparkRecipe"),
    # EAGLE-2 trains EAGLE-1's draft (it differs in the tree it drafts at serving time)
    ("finetune", "eagle"): ("TrainEagle1Recipe", f"{_UPSTREAM}.train_eagle1.TrainEagle1Recipe",
                            "TrainEagle2Recipe", f"{_UPSTREAM}.train_eagle2.TrainEagle2Recipe"),
    # upstream's diffusion-LM recipe and its DiffusionGemma subclass (whose dllm.mode block_diffusion is refused)
    ("finetune", "dllm"): ("DiffusionLMSFTRecipe", "nemo_automodel.recipes.dllm.train_ft.DiffusionLMSFTRecipe",
                           "DiffusionGemmaSFTRecipe", "nemo_automodel.recipes.dllm.train_ft.DiffusionGemmaSFTRecipe"),
}


# upstream's other speculative-decoding draft recipes (examples/speculative/; its EAGLE-1/2 are `finetune eagle`,
# its EAGLE-3 `finetune eagle3`, its DFlash, JetSpec, Domino, DFlash 2 and DSpark `finetune dflash / jetspec /
# domino / dflash2 / dspark`): module -> class names
_SPECULATIVE = {"train_vispec": ("TrainVispecRecipe", "TrainVispecStage1Recipe")}
SPECULATIVE_UNBUILT = ("upstream's speculative-decoding recipes other than EAGLE-1/2/3 (with P-EAGLE), DFlash, "
                       "DFlash 2, JetSpec, Domino and DSpark (its ViSpec) train draft architectures that are not built "
                       "here; EAGLE-1/2 are: recipe: TrainEagle1Recipe / TrainEagle2Recipe, or automodel finetune "
                       "eagle; EAGLE-3 and P-EAGLE are: recipe: TrainEagle3Recipe, or automodel finetune eagle3 "
                       "(P-EAGLE with eagle3.parallel_drafting: true); DFlash, DFlash 2, JetSpec, Domino and DSpark "
                       "are: recipe: TrainDFlashRecipe / TrainDFlash2Recipe / "
                       "TrainJetSpecRecipe / TrainDominoRecipe / TrainDSparkRecipe, or automodel finetune dflash / "
                       "dflash2 / jetspec / domino / dspark")


# the speculative-decoding draft routes (finetune <domain>): recipe, what it trains; each ships llm/tiny_<domain>
_DRAFT_ROUTES = {
    "eagle3": ("automodel_llm.eagle3.recipe.Eagle3Recipe",
               "an EAGLE-3 speculative-decoding draft (for SGLang / vLLM)"),
    "eagle": ("automodel_llm.eagle.recipe.EagleRecipe",
              "an EAGLE-1 / EAGLE-2 speculative-decoding draft (vLLM / SGLang)"),
    "dflash": ("automodel_llm.dflash.recipe.DFlashRecipe", "a DFlash block-drafting speculative-decoding draft"),
    "jetspec": ("automodel_llm.dflash.recipe.JetSpecRecipe",
                "a JetSpec draft (DFlash's, causal within a block, distilled from the target)"),
    "domino": ("automodel_llm.dflash.recipe.DominoRecipe", "a Domino draft (DFlash's with a GRU correction head)"),
    "dflash2": ("automodel_llm.dflash.recipe.DFlash2Recipe",
                "a DFlash 2 draft (DFlash's with dynamic convolutions and a path selector)"),
    "dspark": ("automodel_llm.dflash.dspark.DSparkRecipe",
               "a DSpark draft (DFlash's backbone with a serial Markov head and a confidence head)"),
}


@hookimpl
def automodel_register_routes(routes) -> None:
    routes.add("finetune", "llm", recipe=_RECIPE, help="Fine-tune a causal language model",
               examples=["llm/tiny_squad"])
    routes.add("pretrain", "llm", recipe=_RECIPE,
               help="Pre-train a causal language model (same recipe, config differs)")
    routes.add("kd", "llm", recipe="automodel_llm.kd.KnowledgeDistillationRecipe",
               help="Distil a frozen teacher_model into the student model")
    routes.add("benchmark", "llm", recipe="automodel_llm.benchmark.BenchmarkRecipe",
               help="Measure training throughput on synthetic data (JSON with tokens/s, step times, memory, MFU)",
               examples=["llm/tiny_benchmark"])
    routes.add("finetune", "seq-cls", recipe="automodel_llm.seq_cls.SequenceClassificationRecipe",
               help="Fine-tune a sequence classifier (a text or text pair in, one of num_labels classes out)",
               examples=["llm/tiny_seq_cls"])
    for domain, (recipe, words) in _DRAFT_ROUTES.items():
        routes.add("finetune", domain, recipe=recipe, help=f"Train {words} for a frozen target model",
                   examples=[f"llm/tiny_{domain}"])
    routes.add("finetune", "dllm", recipe="automodel_llm.dllm.DiffusionLMSFTRecipe",
               help="Fine-tune a masked diffusion language model (LLaDA's MDLM objective)",
               examples=["llm/tiny_dllm"])


# (transformers' model package, class name) of upstream's model.config classes that transformers has as its own
_UPSTREAM_CONFIG_CLASSES = (("deepseek_v4", "DeepseekV4Config"), ("deepseek_v32", "DeepseekV32Config"),
                            ("mimo_v2_flash", "MiMoV2FlashConfig"))


@hookimpl
def automodel_register_aliases(aliases) -> None:
    aliases.domain("text", "llm")
    aliases.command("sft", "finetune")
    # Upstream's recipe class names (a config's `recipe:`), by bare name and by path: upstream pre-trains with its
    # fine-tuning recipe too, so that name selects `finetune llm` (the same recipe as `pretrain llm`).
    for route, names in _UPSTREAM_RECIPES.items():
        for name in names:
            aliases.recipe(name, *route)
    aliases.target("SquadDataset", "automodel_llm.datasets.SquadDataset")
    aliases.target("AutoModelForCausalLM", "automodel_llm.AutoModelForCausalLM.from_pretrained")
    aliases.target("pad_collate", "automodel_llm.datasets.collate.pad_collate")
    # Upstream (NeMo AutoModel) public paths, so its users' configs run unchanged.
    aliases.target("nemo_automodel.models.llm.NemotronHForCausalLM", "automodel_llm.models.nemotron_h_for_causal_lm")
    aliases.target("nemo_automodel.datasets.squad.SquadDataset", "automodel_llm.datasets.SquadDataset")
    aliases.target("nemo_automodel.schedulers.CosineAnnealingWarmup", "automodel.optim.CosineAnnealingWarmup")
    for kind in ("CausalLM", "Seq2SeqLM", "SequenceClassification"):
        for method in ("from_pretrained", "from_config"):
            aliases.target(f"nemo_automodel.NeMoAutoModelFor{kind}.{method}",
                           f"automodel_llm.AutoModelFor{kind}.{method}")
    aliases.target("AutoModelForSeq2SeqLM", "automodel_llm.AutoModelForSeq2SeqLM.from_pretrained")
    # transformers' own loader by its path (upstream's diffusion-LM configs name it): ours, which loads the same
    # class and keeps a config's trust_remote_code behind --trust-remote-code
    for method in ("from_pretrained", "from_config"):
        aliases.target(f"transformers.AutoModelForCausalLM.{method}", f"automodel_llm.AutoModelForCausalLM.{method}")
    aliases.target("AutoModelForSequenceClassification",
                   "automodel_llm.AutoModelForSequenceClassification.from_pretrained")
    aliases.target("Seq2SeqDataset", "automodel_llm.datasets.Seq2SeqDataset")
    aliases.target("SequenceClassificationDataset", "automodel_llm.datasets.SequenceClassificationDataset")
    _SEQ_CLS = "nemo_automodel.components.datasets.llm"
    aliases.target(f"{_SEQ_CLS}.seq_cls.GLUE_MRPC", "automodel_llm.datasets.seq_cls.glue_mrpc")
    aliases.target(f"{_SEQ_CLS}.mock_seq_cls.MockSequenceClassificationDataset",
                   "automodel_llm.datasets.MockSequenceClassificationDataset")
    aliases.target("make_seq2seq_dataset", "automodel_llm.datasets.Seq2SeqDataset")
    aliases.target("nemo_automodel.components.datasets.llm.seq2seq.make_seq2seq_dataset",
                   "automodel_llm.datasets.Seq2SeqDataset")
    # upstream's own configuration classes of models that transformers now ships under the same model type
    for model, name in _UPSTREAM_CONFIG_CLASSES:
        for suffix in ("", ".from_pretrained"):
            aliases.target(f"nemo_automodel.components.models.{model}.config.{name}{suffix}",
                           f"transformers.models.{model}.configuration_{model}.{name}{suffix}")
    _KIMI = "nemo_automodel.components.models.kimi_linear.config.KimiLinear48BConfig"
    aliases.target(_KIMI, "automodel_llm.kimi_linear.kimi_linear_config")
    aliases.target(f"{_KIMI}.from_pretrained", "automodel_llm.kimi_linear.kimi_linear_config_from_pretrained")
    aliases.target("nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy",
                   "automodel.training.loss.MaskedCrossEntropy")
    aliases.target("nemo_automodel.components.loss.chunked_ce.ChunkedCrossEntropy",
                   "automodel.training.loss.ChunkedCrossEntropy")
    aliases.target("nemo_automodel.components.datasets.llm.squad.make_squad_dataset",
                   "automodel_llm.datasets.make_squad_dataset")
    aliases.target("ColumnMappedTextInstructionDataset",
                   "automodel_llm.datasets.ColumnMappedTextInstructionDataset")
    aliases.target("nemo_automodel.components.datasets.llm.column_mapped_text_instruction_dataset."
                   "ColumnMappedTextInstructionDataset", "automodel_llm.datasets.ColumnMappedTextInstructionDataset")
    aliases.target("nemo_automodel.components.datasets.utils.default_collater",
                   "automodel_llm.datasets.collate.default_collater")
    aliases.target("nemo_automodel.components.training.rng.StatefulRNG", "automodel.training.rng.StatefulRNG")
    aliases.target("nemo_automodel.components._peft.lora.PeftConfig", "automodel_llm.peft.PeftConfig")
    aliases.target("ChatDataset", "automodel_llm.datasets.ChatDataset")
    aliases.target("nemo_automodel.components.datasets.llm.chat_dataset.ChatDataset",
                   "automodel_llm.datasets.ChatDataset")
    aliases.target("AgentChatDataset", "automodel_llm.datasets.AgentChatDataset")
    aliases.target("make_agent_chat_dataset", "automodel_llm.datasets.AgentChatDataset")
    aliases.target("nemo_automodel.components.datasets.llm.agent_chat.make_agent_chat_dataset",
                   "automodel_llm.datasets.AgentChatDataset")
    aliases.target("XlamDataset", "automodel_llm.datasets.XlamDataset")
    aliases.target("make_xlam_dataset", "automodel_llm.datasets.XlamDataset")
    aliases.target("nemo_automodel.components.datasets.llm.xlam.make_xlam_dataset",
                   "automodel_llm.datasets.XlamDataset")
    aliases.target("PretrainingTextDataset", "automodel_llm.datasets.PretrainingTextDataset")
    aliases.target("MockDataset", "automodel_llm.datasets.MockDataset")
    aliases.target("nemo_automodel.components.datasets.llm.hellaswag.HellaSwag", "automodel_llm.datasets.HellaSwag")
    _UPSTREAM_LOSS = "nemo_automodel.components.loss"
    aliases.target(f"{_UPSTREAM_LOSS}.linear_ce.FusedLinearCrossEntropy",
                   "automodel.training.linear_ce.LinearCrossEntropy")
    for module, names in _SPECULATIVE.items():
        for name in names:
            aliases.unsupported(name, SPECULATIVE_UNBUILT)
            aliases.unsupported(f"{_UPSTREAM}.{module}.{name}", SPECULATIVE_UNBUILT)
    aliases.unsupported(f"{_UPSTREAM_LOSS}.te_parallel_ce.TEParallelCrossEntropy",
                        "Transformer Engine's fused cross entropy needs a CUDA GPU and Transformer Engine; remove "
                        "loss_fn (the default, MaskedCrossEntropy)")
    aliases.unsupported("nemo_automodel.components.datasets.utils.packed_sequence_thd_collater",
                        "THD batches (sequences concatenated, qkv_format thd) feed Transformer Engine's attention "
                        "kernels, which need a CUDA GPU and Transformer Engine; remove collate_fn (the default "
                        "pads each batch; packed_sequence: packs samples for Hugging Face attention)")
    _PREFIX_TREE = ("shared-prefix rollouts (one prompt, several completions, the prompt stored once) feed "
                    "MagiAttention's prefix-tree masks (model.backend.attn: magi), which need a CUDA GPU and "
                    "MagiAttention; train on the rollouts as separate samples (one prompt + completion each)")
    aliases.unsupported("nemo_automodel.components.datasets.llm.prefix_tree.prefix_tree_collate_fn", _PREFIX_TREE)
    aliases.unsupported("nemo_automodel.components.datasets.llm.mock_prefix_tree.build_mock_rollout_dataset",
                        _PREFIX_TREE)
    aliases.target("MegatronPretraining", "automodel_llm.datasets.megatron.MegatronPretraining")
    aliases.target("nemo_automodel.components.datasets.llm.megatron_dataset.MegatronPretraining",
                   "automodel_llm.datasets.megatron.MegatronPretraining")
    aliases.target("nemo_automodel.components.datasets.llm.mock_iterable_dataset.MockIterableDataset",
                   "automodel_llm.datasets.mock_iterable_dataset")
    aliases.target("nemo_automodel.components.datasets.llm.mock.build_unpacked_dataset",
                   "automodel_llm.datasets.MockSentencesDataset")
    aliases.target("NanogptDataset", "automodel_llm.datasets.nanogpt.NanogptDataset")
    aliases.target("nemo_automodel.components.datasets.llm.nanogpt_dataset.NanogptDataset",
                   "automodel_llm.datasets.nanogpt.NanogptDataset")
    aliases.target("build_gpt2_model", "automodel_llm.gpt2.build_gpt2_model")
    aliases.target("nemo_automodel.components.models.gpt2.build_gpt2_model", "automodel_llm.gpt2.build_gpt2_model")


@hookimpl
def automodel_register_commands(cli) -> None:
    from automodel_llm.export import export

    cli.add_command(export)


@hookimpl
def automodel_allowed_targets() -> list[str]:
    return [
        "automodel_llm",  # its own package
        "transformers.AutoConfig",  # model.config: AutoConfig.from_pretrained (upstream configs)
        "transformers.AutoConfig.for_model",  # model.config built from keys
        "peft.LoraConfig",  # peft: used as given
    ]
