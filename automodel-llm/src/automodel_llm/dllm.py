"""Diffusion language models (``automodel finetune dllm``): upstream's ``DiffusionLMSFTRecipe`` in its
``dllm.mode: mdlm`` (masked diffusion, the LLaDA recipe) and ``idlm`` (introspective diffusion,
:mod:`automodel_llm.idlm`).

In mode mdlm each step, every supervised token of a row is replaced by the mask token with the row's probability
``p = (1 - eps) * t + eps``, ``t ~ U[0, 1)`` drawn per row; the model sees the corrupted rows with attention both ways
and is trained to recover the masked tokens: the loss is ``sum over masked tokens of CE / p``, divided by the
supervised tokens of the step (the core's token-weighted step, as upstream normalises it). The masks are drawn from
generators seeded by the run's seed, the step and each row's tokens, so a resumed run draws the same ones, a row the
same mask on any number of ranks, and validation the same masks at every validation (its losses compare across
steps).

Upstream's other modes need models or a second model this build does not have, and are refused with their reasons
(see :data:`UNBUILT_MODES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from automodel.config import Config, ConfigNode, FieldErrors, Refused
from automodel.errors import AutomodelError, ConfigIssue
from automodel.model_backend import asked_attention
from automodel.training.context import BuildContext
from automodel.training.loss import IGNORE_INDEX, LINEAR, loss_fn_named
from automodel.training.modules import is_decoder, unwrap
from automodel.training.next_token import label_positions, next_token_logits
from automodel.training.parallelism import model_hf_config
from automodel_llm.idlm import MASKED_ATTENTION, idlm_inputs, idlm_targets
from automodel_llm.recipe import FinetuneRecipeForNextTokenPrediction, config_labels_shifted
from automodel_llm.row_seeds import RowSeeds, SeededSteps
from automodel_llm.tokenizer import dataset_sections, local_tokenizer

UNBUILT_MODES = {
    "block_diffusion": "block diffusion trains Google's DiffusionGemma (upstream's DiffusionGemmaSFTRecipe: its "
                       "encoder and block canvas with self-conditioning), a model transformers and this build do not "
                       "have",
    "hybrid": "the hybrid objective adds the autoregressive loss of the causal logits that Nemotron-Labs-Diffusion's "
              "own model code returns beside its diffusion logits; this build trains transformers' classes, which "
              "return no such second output",
    "dflash": "DFlash trains a block-drafting speculative decoder against a second, frozen target model (upstream's "
              "dflash: section), which the diffusion-LM recipe does not train: automodel finetune dflash (recipe: "
              "TrainDFlashRecipe) does, its model: section the target (upstream's dflash.target_model_id), "
              "dflash.draft_weights_path the draft to start from (upstream's model: here; a published DFlash "
              "drafter's directory is read with this build's class, no remote code), dflash.num_anchors upstream's "
              "num_blocks_per_sample, and dflash.mask_token_id, block_size and target_layer_ids the draft's",
}
MODES = ("mdlm", "idlm")
# upstream's dllm keys that only the modes above read: (the value meaning "not set", the mode that reads it)
OTHER_MODES_KEYS = {"block_size": "block_diffusion", "half_life_ratio": "block_diffusion",
                    "pad_block_size": "block_diffusion or hybrid", "pad_seq_len_divisible": "block_diffusion or hybrid",
                    "vocab_size": "block_diffusion", "ar_loss_alpha": "hybrid"}
IDLM_KEYS = ("block_length", "clean_loss_weight", "auto_balance_clean_loss")


def _other_mode(mode: str) -> dict[str, Any]:
    return {"help": f"upstream's key of mode {mode}, which is not built here: unset only"}


@dataclass
class DiffusionLMConfig:
    mode: str = field(default="mdlm", metadata={"help": (
        "mdlm: masked diffusion (LLaDA's objective); idlm: introspective diffusion (I-DLM's all-masked objective on "
        "a causal LM); upstream's block_diffusion, hybrid and dflash are refused with their reasons")})
    mask_token_id: int | None = field(default=None, metadata={"help": (
        "the token that replaces masked tokens (mdlm's default: the tokenizer's mask token; idlm: required)")})
    eps: float = field(default=1e-3, metadata={"help": "mdlm: the smallest masking rate of a row, in (0, 1]"})
    supervise_padding: bool = field(default=False, metadata={"help": (
        "true: a row's padding is supervised too (its pad tokens are masked and recovered like the answer's, "
        "LLaDA's SFT: the model learns to end an answer with padding); false: padding carries no loss")})
    block_size: int | None = field(default=None, metadata=_other_mode("block_diffusion"))
    half_life_ratio: float | None = field(default=None, metadata=_other_mode("block_diffusion"))
    pad_block_size: int | None = field(default=None, metadata=_other_mode("block_diffusion or hybrid"))
    pad_seq_len_divisible: int | None = field(default=None, metadata=_other_mode("block_diffusion or hybrid"))
    vocab_size: int | None = field(default=None, metadata=_other_mode("block_diffusion"))
    ar_loss_alpha: float | None = field(default=None, metadata=_other_mode("hybrid"))
    block_length: int | None = field(default=None, metadata={"help": (
        "idlm: the diffusion block (default 1): a masked token sees its own block's masked tokens up to itself and "
        "the clean tokens of earlier blocks")})
    clean_loss_weight: float | None = field(default=None, metadata={"help": (
        "idlm: the weight of the clean copy's loss (default 0.2)")})
    auto_balance_clean_loss: bool | None = field(default=None, metadata={"help": (
        "idlm: true weights the clean copy's loss by CE(x_t) / CE(x_0) of each micro-batch instead")})

    def __post_init__(self) -> None:
        errors = {}
        if self.mode in UNBUILT_MODES:
            errors["mode"] = f"{self.mode}: {UNBUILT_MODES[self.mode]}; modes mdlm and idlm are built"
        elif self.mode not in MODES:
            errors["mode"] = f"expected mdlm or idlm (or upstream's {', '.join(UNBUILT_MODES)}), found {self.mode!r}"
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0 < self.eps <= 1:
            errors["eps"] = f"expected a number in (0, 1], found {self.eps!r}"
        if self.mask_token_id is not None and (isinstance(self.mask_token_id, bool) or self.mask_token_id < 0):
            errors["mask_token_id"] = f"expected a token id >= 0, found {self.mask_token_id!r}"
        for key, mode in OTHER_MODES_KEYS.items():
            if getattr(self, key) is not None and self.mode in MODES:
                errors[key] = (f"{getattr(self, key)!r} is read by upstream's mode {mode} only, not by "
                               f"{self.mode}: remove it")
        if self.mode == "mdlm":
            errors |= {key: f"{getattr(self, key)!r} is read by mode idlm only: remove it"
                       for key in IDLM_KEYS if getattr(self, key) is not None}
        elif self.mode == "idlm":
            errors |= self.idlm_errors()
        if errors:
            raise FieldErrors(errors)

    def idlm_errors(self) -> dict[str, str]:
        errors = {}
        if self.mask_token_id is None:
            errors["mask_token_id"] = "mode idlm needs it set (upstream's rule: a wrong id trains on a real token)"
        if self.eps != 1e-3:
            errors["eps"] = "the masking rate's floor of mode mdlm; idlm masks every answer token: remove it"
        if self.supervise_padding:
            errors["supervise_padding"] = "true: idlm supervises the answer tokens only (as upstream's): set false"
        block = self.block_length
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            errors["block_length"] = f"expected a whole number >= 1, found {block!r}"
        weight = self.clean_loss_weight
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0):
            errors["clean_loss_weight"] = f"expected a number >= 0, found {weight!r}"
        if weight is not None and self.auto_balance_clean_loss:
            errors["clean_loss_weight"] = "given with auto_balance_clean_loss: true, which replaces it: remove one"
        return errors


def corrupt(ids: torch.Tensor, labels: torch.Tensor, lengths: list[int], eps: float,
            seeds: RowSeeds) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked, rate)``: which supervised positions (``labels != IGNORE_INDEX``) to mask, each row's with its rate
    ``(1 - eps) * t + eps``, ``t ~ U[0, 1)``; and the rows' rates. Row ``r``'s draws come from the generator of its
    first ``lengths[r]`` tokens (its real ones), the rate first, then one number per position, so its padding does
    not change the mask of its real tokens. Drawn on the host, so the masks do not depend on the device."""
    rows, length = labels.shape
    masked, rate = torch.zeros(rows, length, dtype=torch.bool), torch.empty(rows)
    ids = ids.cpu()  # one copy to the host for the rows' seeds
    for row in range(rows):
        generator = seeds.generator(ids[row, :lengths[row]])
        rate[row] = (1 - eps) * torch.rand(1, generator=generator).item() + eps
        masked[row] = torch.rand(length, generator=generator) < rate[row]
    return masked.to(labels.device) & (labels != IGNORE_INDEX), rate.to(labels.device)


class DiffusionLMSFTRecipe(SeededSteps, FinetuneRecipeForNextTokenPrediction):
    """Fine-tunes a diffusion LM: the next-token recipe's model, data, sharding and checkpoints, with the corruption
    and loss of ``dllm.mode``. In mode mdlm a decoder's attention is made bidirectional (``config.is_causal: false``,
    saved in its config.json, which transformers honours when it loads the model); in mode idlm the model stays a
    causal LM and gets I-DLM's attention mask."""

    adds_mtp_loss = False  # the heads predict later tokens of a causal model; this loss has no next token
    tensor_parallel_unsupported = ("the loss weights each row's tokens by the row's masking rate on whole logits, "
                                   "which tensor parallelism keeps sharded over the vocabulary; use tp_size: 1 "
                                   "(FSDP2 and DDP shard and replicate the model)")
    pipeline_parallel_unsupported = ("the pipeline's last stage computes the next-token loss, without the rows' "
                                     "masks and masking rates; use pp_size: 1")
    context_parallel_unsupported = ("context parallelism here splits causal attention over the ranks; the diffusion "
                                    "model attends both ways over the whole row; use cp_size: 1")
    sections: ClassVar[dict] = {
        "dllm": DiffusionLMConfig,
        "dflash": Refused(f"the settings of upstream's dllm.mode dflash: {UNBUILT_MODES['dflash']}"),
    }
    reads_unshifted = True  # a data set's upstream unshifted: true is this recipe's form of its labels
    seeds: RowSeeds

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg))
        for key in ("eval_generation", "tool_call_eval"):
            if key in cfg and cfg.get(key) is not None and getattr(cfg.get(key), "enabled", True):
                issues.append(ConfigIssue(key, "generates text one next token at a time, which a diffusion model "
                                          "does not do (it unmasks a whole canvas); remove the section"))
        packing = cfg.get("packed_sequence")
        if packing is not None and (packing.enabled or packing.packed_sequence_size > 0):
            issues.append(ConfigIssue("packed_sequence", "packing puts several samples in a row, and the diffusion "
                                      "objectives attend across the whole row (mdlm both ways; idlm's mask spans the "
                                      "row's two copies), so the samples would see each other; remove the section"))
        if config_labels_shifted(cfg):
            issues.append(ConfigIssue("dataset._target_", "its labels are the next tokens (pre-shifted); the "
                                      "diffusion loss recovers each token at its own position: use a data set whose "
                                      "labels are the input tokens (ChatDataset, ColumnMappedTextInstructionDataset, "
                                      "SquadDataset)"))
        for key, node, _ in dataset_sections(cfg):
            if node.get("unshifted") is False:
                issues.append(ConfigIssue(f"{key}.unshifted", "false: the diffusion loss recovers each token at its "
                                          "own position (upstream's unshifted form); set true or remove it"))
        if loss_fn_named(cfg, LINEAR) is not None:
            issues.append(ConfigIssue("loss_fn._target_", "FusedLinearCrossEntropy sums the loss inside the output "
                                      "head, which cannot weight each row by its masking rate; use "
                                      "MaskedCrossEntropy or ChunkedCrossEntropy"))
        settings = cfg.get("dllm") if "dllm" in cfg else DiffusionLMConfig()
        if settings is not None:  # None: the section itself was refused (its issues are reported)
            issues += cls.settings_issues(cfg, settings)
        return issues

    @classmethod
    def settings_issues(cls, cfg: Config, settings: DiffusionLMConfig) -> list[ConfigIssue]:
        """What the ``dllm`` settings need of the model and the tokenizer: an attention idlm's mask can be given to,
        a mask token (mdlm: the tokenizer's when none is set), inside the model's vocabulary."""
        issues = []
        mask_id = settings.mask_token_id
        if settings.mode == "idlm":
            asked = asked_attention(cfg.model.to_dict()) if isinstance(cfg.get("model"), ConfigNode) else None
            if asked is not None and asked[1] not in MASKED_ATTENTION:
                issues.append(ConfigIssue(f"model.{asked[0]}", f"{asked[1]!r}: mode idlm gives the model I-DLM's "
                                          "attention mask, which sdpa and eager attention take; use one of them"))
        elif mask_id is None:
            tokenizer = local_tokenizer(cfg)
            if tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is None:
                issues.append(ConfigIssue("dllm.mask_token_id", "not set, and the tokenizer has no mask token; set "
                                          "it to the id of the token that stands for a masked one (LLaDA's is "
                                          "126336)"))
        vocab = getattr(model_hf_config(cfg), "vocab_size", None)
        if mask_id is not None and isinstance(vocab, int) and mask_id >= vocab:
            issues.append(ConfigIssue("dllm.mask_token_id", f"{mask_id} is not a token of the model, whose vocabulary "
                                      f"has {vocab} tokens"))
        return issues

    def setup(self) -> None:
        super().setup()
        settings = self.cfg.get("dllm") or DiffusionLMConfig()
        self.mode, self.eps, self.supervise_padding = settings.mode, float(settings.eps), settings.supervise_padding
        self.mask_token_id = self.resolve_mask_token(settings.mask_token_id)
        self.seeds = RowSeeds(self.cfg.rng.seed)  # mdlm's masks (idlm masks every answer token)
        model = unwrap(self.model)
        if self.mode == "idlm":
            self.setup_idlm(model, settings)
            return
        if getattr(model.config, "is_causal", True) is False and is_decoder(model):
            self.log("attention: bidirectional (config.is_causal: false, saved with the model)")
        self.log(f"masked diffusion (mdlm): mask token {self.mask_token_id}, masking rates in [{self.eps}, 1), "
                 f"padding {'supervised' if self.supervise_padding else 'not supervised'}")

    def build_model(self, ctx: BuildContext) -> torch.nn.Module:
        """The model section's model; in mode mdlm a decoder's attention made bidirectional (``config.is_causal:
        false``: transformers' mask builders then give every token every other), here rather than in setup so that
        ``automodel export`` merges a LoRA adapter into a base that attends as training did."""
        model = super().build_model(ctx)
        settings = self.cfg.get("dllm") or DiffusionLMConfig()
        if settings.mode == "mdlm" and is_decoder(model):
            model.config.is_causal = False
        return model

    def final_message(self, model_dir: Path) -> str:
        message = super().final_message(model_dir)
        if self.mode == "mdlm" and (model_dir / "adapter_config.json").is_file():
            message += (" over a base whose config says is_causal = False (the adapter was trained with attention "
                        "both ways): config = AutoConfig.from_pretrained(base); config.is_causal = False; "
                        "AutoModelForCausalLM.from_pretrained(base, config=config); the merged model's config.json "
                        "says so itself")
        return message

    def setup_idlm(self, model: torch.nn.Module, settings: DiffusionLMConfig) -> None:
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in MASKED_ATTENTION:
            raise AutomodelError(f"dllm.mode: idlm gives the model I-DLM's attention mask, which sdpa and eager "
                                 f"attention take, but it runs {attention!r}: set model.attn_implementation: sdpa")
        self.additive_mask = attention == "eager"
        self.block = settings.block_length or 1
        self.clean_weight = 0.2 if settings.clean_loss_weight is None else float(settings.clean_loss_weight)
        self.auto_balance = bool(settings.auto_balance_clean_loss)
        weight = "CE(x_t) / CE(x_0) per micro-batch" if self.auto_balance else self.clean_weight
        self.log(f"introspective diffusion (idlm): mask token {self.mask_token_id}, blocks of {self.block}, "
                 f"loss CE(x_t) + {weight} x CE(x_0) over the answer tokens")

    def resolve_mask_token(self, given: int | None) -> int:
        mask_id = given if given is not None else getattr(self.tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise AutomodelError("dllm.mask_token_id: not set, and the tokenizer has no mask token; set it to the id "
                                 "of the token that stands for a masked one (LLaDA's is 126336)")
        vocab = unwrap(self.model).get_input_embeddings().num_embeddings
        if not 0 <= int(mask_id) < vocab:
            raise AutomodelError(f"dllm.mask_token_id: {mask_id} is not a token of the model, whose embeddings hold "
                                 f"{vocab} tokens")
        return int(mask_id)

    # ---- the loss ------------------------------------------------------------------------------------------

    def clean_rows(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, targets)``: the rows with their padding as the tokenizer's pad token (what upstream's
        collator pads with, whatever collate_fn built the batch), and the tokens to recover, ``IGNORE_INDEX``
        elsewhere: the labels (each token at its own position), with ``supervise_padding`` the padding's too."""
        ids, labels, mask = batch["input_ids"], batch["labels"], batch.get("attention_mask")
        if mask is not None:
            padding = mask.to(ids.device) == 0
            ids = torch.where(padding, self.pad_token_id, ids)
            if self.supervise_padding:
                labels = torch.where(padding.to(labels.device), ids.to(labels.device), labels)
        return ids, labels

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int((self.clean_rows(batch)[1] != IGNORE_INDEX).sum())

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.mode == "idlm":
            return self.idlm_loss(model, batch)
        return self.mdlm_loss(model, batch)

    def mdlm_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The masked tokens' cross entropy (``loss_fn``, summed) over each row, divided by the row's masking rate;
        the model gets the corrupted rows without an attention mask (upstream's: the rows are attended whole)."""
        ids, labels = self.clean_rows(batch)
        mask = batch.get("attention_mask")
        lengths = mask.sum(dim=1).tolist() if mask is not None else [ids.shape[1]] * ids.shape[0]
        masked, rate = corrupt(ids, labels, lengths, self.eps, self.seeds)
        targets = torch.where(masked, labels, IGNORE_INDEX)
        inputs = {"input_ids": torch.where(masked, self.mask_token_id, ids), "use_cache": False}
        if "position_ids" in batch:
            inputs["position_ids"] = batch["position_ids"]
        index = label_positions(targets, offset=0)
        logits, flat_targets = next_token_logits(model, inputs, targets, index, self.head_positions, offset=0)
        rows = index // targets.shape[1]
        total = logits.sum().float() * 0  # a micro-batch with nothing masked still joins the backward
        for row in rows.unique().tolist():
            chosen = rows == row
            total = total + self.loss_fn(logits[chosen], flat_targets[chosen]).float() / rate[row]
        return total

    def idlm_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``CE(x_t) + weight x CE(x_0)`` of the ``[x_t | x_0]`` forward (:mod:`automodel_llm.idlm`), each the
        ``loss_fn`` sum over the answer tokens; the two parts are logged as ``loss_noisy`` and ``loss_clean``."""
        ids, labels = self.clean_rows(batch)
        valid = batch.get("attention_mask")
        valid = torch.ones_like(ids) if valid is None else valid.to(ids.device)
        inputs = idlm_inputs(ids, labels != IGNORE_INDEX, valid, self.mask_token_id, self.block, self.additive_mask)
        targets = idlm_targets(labels)
        index = label_positions(targets, offset=0)
        logits, flat_targets = next_token_logits(model, inputs, targets, index, self.head_positions, offset=0)
        clean = index % targets.shape[1] >= ids.shape[1]
        noisy_sum = self.loss_fn(logits[~clean], flat_targets[~clean]).float()
        clean_sum = self.loss_fn(logits[clean], flat_targets[clean]).float()
        weight = (noisy_sum / clean_sum.clamp_min(1e-6)).detach() if self.auto_balance else self.clean_weight
        if model.training:
            self.add_loss_part("noisy", noisy_sum)
            self.add_loss_part("clean", clean_sum)
        return noisy_sum + weight * clean_sum
