"""Next-token-prediction recipe for fine-tuning and pre-training causal LMs, on the core's shared loop."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from automodel.auto_class import loading_auto_class
from automodel.config import ArgumentsFor, Config, ConfigNode, FieldErrors, Free, Metadata, Refused, Target
from automodel.errors import AutomodelError, ConfigIssue
from automodel.gate_precision import router_issues
from automodel.hf import (
    EvalGenerationConfig,
    align_special_tokens,
    check_vocab,
    exact_match,
)
from automodel.model_backend import asked_attention, attention_support_issue, backend_setting
from automodel.training.checkpoint_write import sharded_only_message
from automodel.training.context import BuildContext
from automodel.training.dist import expected_world_size, rank
from automodel.training.expert_load import ExpertLoads, MoEMetricsConfig
from automodel.training.modules import is_fsdp2, root_gathered, unwrap
from automodel.training.mtp_loss import MTPLoss
from automodel.training.next_token import NextTokenLogits
from automodel.training.parallel.context_parallel import cp_attention
from automodel.training.parallel.pipeline_parallel import PipelineSettings
from automodel.training.parallelism import model_hf_config, rows_per_batch, validation_device
from automodel.training.pipeline_steps import padded_tokens, pipeline_length, stage_kwargs
from automodel.training.recipe import TrainRecipe
from automodel_llm.datasets.collate import pad_collate
from automodel_llm.datasets.megatron import MegatronPretraining
from automodel_llm.datasets.packing import PackedDataset, packed_collate
from automodel_llm.datasets.pretraining import (
    batch_size_issues,
    drawn_vocab_issues,
    label_form_issues,
    position_table_issues,
)
from automodel_llm.embeddings import (
    EmbeddingRowRepairConfig,
    NEFTuneConfig,
    add_neftune_noise,
    nvtx_issues,
    repair_embedding_rows,
    repair_issues,
)
from automodel_llm.seq2seq import check_decoder_start, seq2seq_issues
from automodel_llm.tokenizer import VOCAB_PROBLEM, build_tokenizer, dataset_sections, tokenizer_issues
from automodel_llm.tool_call_eval import ToolCallEvalConfig, ToolCallEvaluator, given_settings, tool_call_eval_issues
from automodel_llm.tool_call_eval import metrics as tool_call_metrics

IGNORE_INDEX = -100
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "decoder_input_ids")  # the last: an encoder-decoder's
DATASETS = tuple(f"automodel_llm.datasets.{name}" for name in (
    "SquadDataset", "make_squad_dataset", "ColumnMappedTextInstructionDataset", "ChatDataset",
    "AgentChatDataset", "XlamDataset", "PretrainingTextDataset", "MegatronPretraining", "MockDataset",
    "Seq2SeqDataset"))


def attention_support_issues(cfg: Config) -> list[ConfigIssue]:
    """The attention the model section asks for, where its transformers class has none of that kind (building the
    model would fail); nothing when the class cannot be told here."""
    model = cfg.get("model")
    asked = asked_attention(model.to_dict()) if isinstance(model, ConfigNode) else None
    if asked is None or (hf_config := model_hf_config(cfg)) is None:
        return []
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(hf_config)]
    except KeyError:  # not a causal LM transformers knows (a sequence-to-sequence model, a model's own code)
        return []
    why = attention_support_issue(model_class, asked[1])
    return [ConfigIssue(f"model.{asked[0]}", why)] if why else []


def dataset_section(help: str, required: bool = False) -> Target:
    """A data set section: the recipe passes its tokenizer; the LLM data sets are documented with it."""
    return Target(help, required=required, runtime_args=("tokenizer",), documented_targets=DATASETS)


@dataclass
class PackedSequenceConfig:
    # upstream's PackingConfig keys that choose nothing here: (values accepted, being what happens, why any other is
    # refused)
    upstream_refused: ClassVar[dict[str, tuple[tuple, str]]] = {
        "prepacked": ((False, None), "a data set of rows packed beforehand is not read as such here: packing packs "
                                     "the samples the data set yields; remove it"),
        "drop_long_samples": ((None,), "a setting of upstream's neat packing (packing_strategy: neat), which is not "
                                       "implemented here; remove it"),
    }
    enabled: bool = field(default=False, metadata={"help": "pack several samples into each row"})
    packed_sequence_size: int = field(default=0, metadata={"help": "tokens per packed row (0: packing off)"})
    split_across_pack: bool = field(default=False, metadata={"help": "let a sample continue in the next row"})
    max_packs: int | None = field(default=None, metadata={"help": "stop after this many packed rows"})
    packing_strategy: Literal["thd", "neat"] = field(default="thd", metadata={"help": (
        "upstream's strategy: thd, samples packed in order into rows of packed_sequence_size (what packs here, "
        "attention kept within each sample); neat (bin-packing) is refused")})
    num_proc: int = field(default=1, metadata={"help": (
        "upstream's worker processes tokenizing a lazily tokenized data set before packing: 1 only (the data sets "
        "here are tokenized when built, before packing)")})

    def __post_init__(self) -> None:
        errors = {}
        if self.packing_strategy == "neat":
            errors["packing_strategy"] = ("neat (upstream's bin-packing with its own collater) is not implemented; use "
                                          "thd (or remove the key): samples packed in order")
        if self.num_proc != 1:
            errors["num_proc"] = (f"{self.num_proc}: upstream tokenizes a lazily tokenized data set in that many "
                                  "processes before packing; the data sets here are tokenized when built, before "
                                  "packing, which leaves those processes nothing to do: set 1 or remove it")
        if errors:
            raise FieldErrors(errors)


def generation_keys(cfg: Config) -> list[str]:
    """The keys that make this run generate: each is refused where generation cannot run."""
    generation, keys = cfg.get("eval_generation"), []
    if "eval_generation" in cfg and generation is not None and generation.enabled:
        keys.append("eval_generation.enabled")
    if given_settings(cfg) is not None:
        keys.append("tool_call_eval")
    return keys


def turn_off(key: str) -> str:
    """How to stop the generation ``key`` asks for."""
    return "remove the tool_call_eval section" if key == "tool_call_eval" else f"set {key}: false"


def context_parallel_issues(cfg: Config, packing: Any) -> list[ConfigIssue]:
    """What this recipe cannot run with ``distributed.cp_size > 1``: packed rows with ring attention, or rows whose
    length the split does not divide. (Generation runs outside the context-parallel region, on whole sequences
    with the model's own mask, as in one process.)"""
    cp = cfg.distributed.cp_size
    issues: list[ConfigIssue] = []
    if packing is None or not (packing.enabled or packing.packed_sequence_size > 0):
        return issues
    if cp_attention(cfg, validation_device(), model_hf_config(cfg)) == "ring":
        issues.append(ConfigIssue("packed_sequence.packed_sequence_size", f"packed rows keep attention within each "
                                  f"sample, but torch's ring attention (distributed.cp_attention: ring, cp_size {cp}) "
                                  "runs one causal attention over the whole row; set distributed.cp_attention: "
                                  "all_gather (or auto), which keeps the samples apart, or turn packing off "
                                  "(packed_sequence.enabled: false, packed_sequence_size: 0)"))
    elif packing.packed_sequence_size % (2 * cp):
        issues.append(ConfigIssue("packed_sequence.packed_sequence_size", f"{packing.packed_sequence_size}: context "
                                  f"parallelism (cp_size {cp}) splits each packed row into {2 * cp} chunks; use a "
                                  f"multiple of {2 * cp}"))
    return issues


_RUN_TIME = ("filled by upstream's recipe when it builds the model (the model, its device meshes and their axis "
             "names), never from YAML; here distributed.*_size make the mesh: remove the key")
# upstream's parallelize_model(...) arguments (nemo_automodel.components.moe.parallelizer): each stands for the
# distributed key of the same meaning, or is refused with why
PARALLELIZER = ArgumentsFor(
    "nemo_automodel.components.moe.parallelizer.parallelize_model",
    keys={name: f"distributed.{name}" for name in (
        "activation_checkpointing", "reshard_after_forward", "mp_policy", "sequence_parallel",
        "enable_async_tensor_parallel", "offload_policy")} | {
        name: f"distributed.moe.{name}" for name in ("ignore_router_for_ac", "lm_head_precision", "wrap_outer_model")},
    refused={**dict.fromkeys(("model", "world_mesh", "moe_mesh", "dp_axis_names", "cp_axis_name", "tp_axis_name",
                              "ep_axis_name", "ep_shard_axis_names"), _RUN_TIME),
             "activation_checkpointing_scope": "upstream's choice of layer groups to checkpoint; activation "
                                               "checkpointing here covers every transformer block (upstream's 'all'): "
                                               "remove the key",
             "tp_shard_plan": "tensor parallelism here shards by the model's own plan (distributed.tp_size); a plan "
                              "given in the config is not taken: remove the key",
             "frozen_multimodal_sharding": "upstream's FSDP2 policy for frozen vision / audio towers; FSDP2 here "
                                           "shards every transformer block it finds: remove the key"},
    help="the arguments of upstream's MoE parallelizer, each standing for the distributed key of the same meaning")


def pipeline_issues(cfg: Config, packed_size: int) -> list[ConfigIssue]:
    """What this recipe cannot run with ``distributed.pp_size > 1`` (beyond the core's checks, eval_generation's
    among them)."""
    issues = []
    if given_settings(cfg) is not None:
        issues.append(ConfigIssue("tool_call_eval", f"generation runs the whole model token by token, which the "
                                  f"pipeline stages (pp_size {cfg.distributed.pp_size}) hold apart; remove the "
                                  "tool_call_eval section"))
    length = PipelineSettings.from_section(cfg.distributed.pipeline).pp_seq_len  # as given (else: the packed size)
    if isinstance(length, int) and 0 < length < packed_size:
        issues.append(ConfigIssue("distributed.pipeline.pp_seq_len", f"{length} is shorter than the packed rows "
                                  f"(packed_sequence.packed_sequence_size {packed_size}), and every training batch "
                                  f"is padded to pp_seq_len; use a pp_seq_len of at least {packed_size}"))
    return issues


def config_labels_shifted(cfg: Config) -> bool:
    """Whether the training data set section's class declares its labels the next tokens already
    (``labels_shifted``), read from the config alone (for a rank that builds no data)."""
    return any(key == "dataset" and bool(getattr(fn, "labels_shifted", False)) for key, _, fn in dataset_sections(cfg))


class FinetuneRecipeForNextTokenPrediction(MTPLoss, NextTokenLogits, TrainRecipe):
    """Causal LM training: loss on label tokens (answers for SFT, everything for pre-training).

    An encoder-decoder (T5, BART) trains on a source -> target data set: see :mod:`automodel_llm.seq2seq`."""

    domain = "llm"
    encoder_decoder_unsupported: str | None = None  # why a subclass trains no encoder-decoder model
    reads_unshifted = False  # whether a data set's unshifted: true (upstream's diffusion-LM form) is read
    tensor_parallel_unsupported = None  # the loss runs on vocabulary-parallel logits (training/loop.py)
    pipeline_parallel_unsupported = None  # pipeline_batches below; pipeline_loss is NextTokenLogits'
    context_parallel_unsupported = None  # NextTokenLogits' context_parallel_batch; rows padded to 2 x cp_size
    tool_call_evaluator: ToolCallEvaluator | None = None  # tool_call_eval, unless skipped under FSDP2
    tool_call_results: tuple[int, dict[str, float]] | None = None  # (step, metrics): once per validation
    expert_loads: ExpertLoads | None = None  # moe_metrics: the experts' token counts, logged with each step
    sections = {
        "tokenizer": Target("tokenizer (default: the model's): {pretrained_model_name_or_path: ...}", plain=True,
                            default_target="transformers.AutoTokenizer.from_pretrained"),
        "dataset": dataset_section("the training data set", required=True),
        "validation_dataset": dataset_section("a validation data set"),
        "validation_dataset_*": dataset_section("more validation data sets, reported by name"),
        "packed_sequence": PackedSequenceConfig,
        "eval_generation": EvalGenerationConfig,
        "neftune": NEFTuneConfig,
        "moe_metrics": MoEMetricsConfig,
        "autocast": ArgumentsFor(None, keys={"dtype": "distributed.autocast_dtype"}, switch="enabled",
                                 help="the forward's torch.autocast, {enabled: true, dtype: bfloat16}: the same as "
                                      "distributed.autocast_dtype (enabled: false sets nothing); upstream's LLM "
                                      "recipes leave this section of its convergence examples unread"),
        "embedding_row_repair": EmbeddingRowRepairConfig,
        "nvtx": Free("upstream's NVTX ranges around every module for NVIDIA Nsight Systems: false (off) only"),
        "parallelizer": PARALLELIZER,
        "autopipeline": Metadata("a section nothing in upstream reads any more (its pipeline settings are "
                                 "distributed.pipeline with distributed.pp_size, as here): it governs nothing"),
        "quantization": Refused("bitsandbytes 4-/8-bit base weights (QLoRA) need a CUDA GPU and bitsandbytes, and this "
                                "build loads no quantized weights: remove the section (LoRA on bf16 / fp32 weights)"),
        "tool_call_eval": ToolCallEvalConfig,
        "longalign": Metadata("a key of upstream's GLM-5.2 LoRA example that nothing in upstream reads"),
        "recipe_args": Refused("the section of upstream's speculative-decoding recipes, which train a draft model "
                               "against a frozen target: EAGLE-1/2's (TrainEagle1Recipe, TrainEagle2Recipe) is "
                               "automodel finetune eagle, EAGLE-3's (TrainEagle3Recipe) automodel finetune eagle3, "
                               "DFlash's and its variants' (TrainDFlashRecipe, TrainDFlash2Recipe, TrainJetSpecRecipe, "
                               "TrainDominoRecipe, TrainDSparkRecipe) automodel finetune dflash / dflash2 / jetspec / "
                               "domino / dspark (or recipe: "
                               "<that name> with automodel run); the others are not built here. This recipe "
                               "fine-tunes the model section's model"),
        "benchmark": Metadata("the benchmark recipe's settings; fine-tuning ignores them, as upstream's does: "
                              "automodel benchmark llm -c FILE, or recipe: BenchmarkingRecipeForNextTokenPrediction, "
                              "times the steps"),
    }

    # ---- building -------------------------------------------------------------------------------------------

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg)) + tokenizer_issues(cfg)
        datasets = dataset_sections(cfg)
        issues += batch_size_issues(datasets, rows_per_batch(cfg))
        if any(getattr(fn, "pretokenized", False) or fn is MegatronPretraining for _, _, fn in datasets):
            hf_config = model_hf_config(cfg)
            text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
            issues += drawn_vocab_issues(datasets, getattr(text, "vocab_size", None))
            issues += position_table_issues(datasets, text)
        issues += label_form_issues(datasets)
        if not cls.reads_unshifted:
            issues += [ConfigIssue(f"{key}.unshifted", "true is upstream's sample form for diffusion LMs (each token "
                                   "supervised at its own position), which only the diffusion recipe reads: remove it, "
                                   "or use recipe: DiffusionLMSFTRecipe (automodel finetune dllm)")
                       for key, node, _ in datasets if node.get("unshifted") is True]
        issues += seq2seq_issues(cfg, datasets, cls.encoder_decoder_unsupported)
        settings = cfg.distributed
        if settings is not None and settings.tp_size > 1 and settings.sequence_parallel:
            issues += [ConfigIssue(key, f"generation feeds one token at a time, which sequence parallelism cannot "
                                        f"split over the tensor-parallel ranks; {turn_off(key)} or set "
                                        "distributed.sequence_parallel: false") for key in generation_keys(cfg)]
        if given_settings(cfg) is not None:
            issues += tool_call_eval_issues(cfg)
        issues += nvtx_issues(cfg.resolved.get("nvtx"))
        if backend_setting(cfg.model, "gate_precision") is not None:
            issues += router_issues(model_hf_config(cfg))
        issues += cls.mtp_config_issues(cfg) + attention_support_issues(cfg)
        moe_metrics = cfg.get("moe_metrics")
        if moe_metrics is not None and moe_metrics.enabled and settings is not None and settings.pp_size > 1:
            issues.append(ConfigIssue("moe_metrics.enabled", f"true with pp_size {settings.pp_size}: a step's record "
                                      "is written by the first stage's rank, which holds only its own layers' "
                                      "experts; set it false or pp_size: 1"))
        repair = cfg.get("embedding_row_repair")
        sharded = settings is not None and (settings.tp_size > 1 or settings.pp_size > 1 or (
            settings.strategy == "fsdp2" and expected_world_size() > 1))
        if "embedding_row_repair" in cfg and repair is not None and repair.enabled:
            issues += repair_issues(cfg, sharded)
        packing = cfg.get("packed_sequence")
        size = getattr(packing, "packed_sequence_size", 0) or 0
        if settings is not None and settings.pp_size > 1:
            issues += pipeline_issues(cfg, size)
        if settings is not None and settings.cp_size > 1:
            issues += context_parallel_issues(cfg, packing)
        if settings is not None and settings.tp_size > 1 and settings.sequence_parallel and size % settings.tp_size:
            issues.append(ConfigIssue("packed_sequence.packed_sequence_size", f"{size} does not divide by tp_size "
                                      f"{settings.tp_size}: sequence parallelism splits every row over the "
                                      "tensor-parallel ranks; use a multiple of tp_size"))
        return issues

    def setup_domain(self) -> None:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # our own progress bar is the one to watch
        self.tokenizer = build_tokenizer(self.cfg)

    def dataset_runtime_args(self, node: Any) -> dict[str, Any]:
        # run_seed: NanogptDataset's file order; run_samples: the training samples MegatronPretraining builds
        return {"tokenizer": self.tokenizer, "run_seed": self.cfg.rng.seed, "run_samples": self.run_samples()}

    def run_samples(self) -> int | None:
        """The samples the run's steps read: max_steps x global batch size (else the rows per micro-batch);
        None without max_steps (the data set's own epoch)."""
        steps = self.cfg.step_scheduler
        if steps is None or steps.max_steps is None:
            return None
        return steps.max_steps * (steps.global_batch_size or rows_per_batch(self.cfg))

    def collate_runtime_args(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer}

    @property
    def pack_size(self) -> int | None:
        packing = self.cfg.packed_sequence
        if packing is None or not (packing.enabled or packing.packed_sequence_size > 0):
            return None
        if packing.packed_sequence_size < 2:
            raise AutomodelError("packed_sequence.packed_sequence_size: set it (tokens per packed row) when "
                                 "packed_sequence.enabled is true")
        return packing.packed_sequence_size

    def build_dataset(self, ctx: BuildContext, node: Any) -> Any:
        if node is not None and "tokenizer" in node:  # upstream's form of the run's tokenizer, built in setup_domain
            node = ConfigNode({k: v for k, v in node.to_dict().items() if k != "tokenizer"}, node.key, node.resolver)
        dataset = super().build_dataset(ctx, node)
        if node is not None and node.key == "dataset" and self.pack_size:
            packing = self.cfg.packed_sequence
            dataset = PackedDataset(dataset, self.pack_size, packing.split_across_pack, packing.max_packs)
            self.log(f"packed the training data into {len(dataset)} rows of {self.pack_size} tokens")
        return dataset

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id; 0 without a tokenizer (token-id data: padding carries no label)."""
        return getattr(self.tokenizer, "pad_token_id", None) or 0

    def default_collate_fn(self, train: bool = True) -> Any:
        pad = self.pad_token_id
        if train and self.pack_size:
            return functools.partial(packed_collate, pack_size=self.pack_size, pad_token_id=pad)
        return functools.partial(pad_collate, pad_token_id=pad, pad_to_multiple_of=self.length_multiple())

    def length_multiple(self) -> int | None:
        """What the default collate pads each row's length to a multiple of: sequence parallelism splits each row
        over the tensor-parallel ranks, context parallelism into 2 x cp_size chunks (validation refuses both
        together)."""
        settings = self.cfg.distributed
        if settings is not None and settings.cp_size > 1:
            return 2 * settings.cp_size
        return settings.tp_size if settings is not None and settings.sequence_parallel else None

    def setup(self) -> None:
        super().setup()
        if self.tokenizer is None:
            self.log("no tokenizer: the data sets hold token ids (the model's own special token ids stand)")
        else:
            check_vocab(self.tokenizer, getattr(unwrap(self.model), "config", None), "tokenizer: " + VOCAB_PROBLEM)
        if self.is_encoder_decoder:
            check_decoder_start(unwrap(self.model), [self.train_dataset, *(
                loader.dataset for loader in self.val_dataloaders.values())])
        changes = align_special_tokens(unwrap(self.model), self.tokenizer) if self.tokenizer is not None else []
        if changes:
            self.log(f"special tokens: the model's {', '.join(changes)} (the tokenizer's, which training uses; "
                     "saved in config.json and generation_config.json, so generate() stops at its EOS)")
        repair = self.cfg.get("embedding_row_repair")
        if "embedding_row_repair" in self.cfg and repair.enabled:
            self.log(repair_embedding_rows(unwrap(self.model), repair.min_norm, repair.max_rows))
        neftune = self.cfg.get("neftune")
        if neftune is not None and neftune.noise_alpha is not None:
            add_neftune_noise(unwrap(self.model), neftune.noise_alpha)
            self.log(f"NEFTune: noise alpha {neftune.noise_alpha} on the input embeddings while training")
        self.setup_tool_call_eval()
        moe_metrics = self.cfg.get("moe_metrics")
        if moe_metrics is not None and moe_metrics.enabled:
            self.expert_loads = ExpertLoads(unwrap(self.model), moe_metrics)
            self.log(f"moe_metrics: the load of the experts of {len(self.expert_loads.modules)} mixture-of-experts "
                     f"layers logged with each step ({moe_metrics.mode})")

    def train_step(self, batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The core's step; with ``moe_metrics`` the step's expert load metrics join its record."""
        result = super().train_step(batches)
        if self.expert_loads is not None:
            metrics = self.expert_loads.step_metrics(self.step_scheduler.step, self.data_groups(), self.device)
            self.step_loss_parts = {**self.step_loss_parts, **metrics}
        return result

    def setup_tool_call_eval(self) -> None:
        settings = given_settings(self.cfg)
        if settings is None:
            return
        if not settings.run_on_fsdp2 and self.world_size > 1 and is_fsdp2(self.model):
            self.log("tool_call_eval: skipped with the model sharded by FSDP2, as upstream (generating on the sharded "
                     f"model gathers its weights at every token); {settings.metric_prefix}/_disabled_fsdp2 is "
                     "recorded instead. Set tool_call_eval.run_on_fsdp2: true to evaluate anyway")
            return
        self.tool_call_evaluator = ToolCallEvaluator(settings, self.tokenizer)
        how = ""
        if self.world_size > 1:
            how = (", every rank generating each together (the weights are sharded)" if self.forwards_are_collective
                   else f", split over the {self.world_size} ranks (the model is replicated on each)")
        self.log(f"tool_call_eval: {len(self.tool_call_evaluator.samples)} tool-call turns scored at each "
                 f"validation{how}")

    @property
    def tool_call_shard(self) -> tuple[int, int] | None:
        """This rank's share of the tool-call samples: every world_size-th from its rank where the model is
        replicated on each rank; None (all of them) in one process or with sharded weights."""
        return (rank(), self.world_size) if self.world_size > 1 and not self.forwards_are_collective else None

    def extra_validation_metrics(self, name: str, dataloader: Any) -> dict[str, float]:
        """The tool-call metrics (``tool_call_eval``), computed once per validation and recorded with each set."""
        settings, step = given_settings(self.cfg), self.step_scheduler.step
        if settings is None:
            return {}
        if self.tool_call_evaluator is None:
            return {f"{settings.metric_prefix}/_disabled_fsdp2": 1.0}
        if self.tool_call_results is None or self.tool_call_results[0] != step:
            shard = self.tool_call_shard
            with self.forward_context(), root_gathered(unwrap(self.model)):  # peft's generate skips its forward
                tally = self.tool_call_evaluator.score(unwrap(self.model), self.device, shard,
                                                       synced=self.forwards_are_collective)
            if tally.skipped:
                self.log("tool_call_eval: samples skipped on rank 0: " +
                         ", ".join(f"{count} ({reason})" for reason, count in tally.skipped.items()))
            self.tool_call_results = step, tool_call_metrics(tally, settings.metric_prefix, shard is not None,
                                                             self.device)
        return dict(self.tool_call_results[1])

    # ---- the loss ---------------------------------------------------------------------------------------------

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in batch.items() if k in MODEL_INPUTS}, "use_cache": False}

    def pipeline_batches(self, batches: list[dict[str, torch.Tensor]], length: int | None = None
                         ) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """The step's micro-batches padded to :func:`pipeline_length` (padding carries no label and is masked out of
        attention, so the loss is unchanged; packed rows keep no mask, see :func:`stage_kwargs`)."""
        longest = pipeline_length(batches, length)
        parts = []
        for batch in batches:
            extra = longest - batch["input_ids"].shape[1]
            parts.append((*padded_tokens(batch, extra, self.pad_token_id), stage_kwargs(batch, extra)))
        return parts

    @property
    def is_encoder_decoder(self) -> bool:
        """Whether the model is an encoder-decoder (T5, BART), by its config."""
        return bool(getattr(getattr(unwrap(self.model), "config", None), "is_encoder_decoder", False))

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """The labels a loss sums over: after each row's first where the loss shifts them, all where they are the
        next tokens already (``labels_shifted``) or an encoder-decoder's."""
        return int((batch["labels"][:, self.label_offset:] != IGNORE_INDEX).sum())

    def count_input_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Non-padding tokens (what tokens/s counts)."""
        if "token_count" in batch:
            return int(batch["token_count"].sum())
        mask = batch.get("attention_mask")
        return int(mask.sum()) if mask is not None else batch["input_ids"].numel()

    # ---- after training ------------------------------------------------------------------------------------

    def final_message(self, model_dir: Path) -> str:
        if not model_dir.is_dir():
            return sharded_only_message(model_dir.parent)
        if (model_dir / "adapter_config.json").is_file():
            return (f"Trained LoRA adapter in {model_dir}: load it with peft.PeftModel.from_pretrained(base_model, "
                    f"'{model_dir}'), or merge it with `automodel export {model_dir.parent} merged/`")
        tokenizer = f" and AutoTokenizer.from_pretrained('{model_dir}')" if self.tokenizer is not None else ""
        return f"Trained model in {model_dir}: load it with transformers.{loading_auto_class(model_dir)}" \
            f".from_pretrained('{model_dir}')" + tokenizer

    def _generation_pairs(self) -> list[tuple[str, str]]:
        for loader in self.val_dataloaders.values():
            pairs = getattr(loader.dataset, "qa_pairs", None)
            if pairs:
                return list(pairs)
        return []

    def on_train_end(self, final_checkpoint: Path | None) -> None:
        settings = self.cfg.eval_generation
        pairs = self._generation_pairs()
        collective = self.forwards_are_collective  # FSDP2: every rank generates the same answers together
        if settings is not None and settings.enabled and pairs and (self.is_main_process or collective) and \
                "eval_generation" in self.cfg:
            pairs = pairs[: settings.num_examples] if settings.num_examples else pairs
            with self.forward_context(), root_gathered(unwrap(self.model)):  # peft's generate skips its forward
                score, results = exact_match(unwrap(self.model), self.tokenizer, pairs, settings.max_new_tokens,
                                             self.device, synced=collective)
            for prompt, expected, got in results[: settings.num_shown]:
                self.log(f"  Q: {prompt}\n     expected: {expected!r}  model: {got!r}")
            self.log(f"exact match on {len(results)} validation questions: {score:.3f}")
            if final_checkpoint is not None and self.is_main_process:
                record = {"step": self.step_scheduler.step, "exact_match": score, "num_questions": len(results)}
                with open(Path(self.cfg.checkpoint.checkpoint_dir) / "eval_generation.json", "w") as f:
                    json.dump(record, f)
        if final_checkpoint is not None:
            model_dir = final_checkpoint / "model"
            self.log(self.final_message(model_dir))
