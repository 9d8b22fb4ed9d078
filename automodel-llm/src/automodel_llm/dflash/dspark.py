"""DSpark draft training (``automodel finetune dspark``; upstream's ``TrainDSparkRecipe``): DFlash's block drafter
made semi-autoregressive (:mod:`automodel_llm.dflash.spark`). Each block's slots draft the tokens after its anchor;
the loss is ``ce_loss_alpha`` x their cross entropy against the data + ``l1_loss_alpha`` x the L1 distance between
the draft's distributions and the target's + ``confidence_head_alpha`` x the confidence head's binary cross entropy
towards the acceptance probability (``1 - L1 / 2``), every term weighted by the slots' decay, as the step's weighted
mean. Validation adds ``expected_accept_length`` (1 + the sum of a block's running products of acceptance
probabilities, what a sampling verifier accepts on average) and ``confidence_error`` to DFlash's ``accuracy`` and
``accept_length``.

The draft is upstream's Qwen3-style ``Qwen3DSparkModel``, made for any decoder target whose embeddings are a plain
lookup, or for a Gemma 4 target upstream's ``Gemma4DSparkModel`` (:mod:`automodel_llm.dflash.spark_gemma4`); the
targets for which upstream builds a draft of another architecture (DeepSeek V4, GLM-5.2 and Kimi K3's MLA drafts,
MiniMax M3's) are refused with the reason.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from automodel.config import Config
from automodel.errors import AutomodelError, ConfigIssue
from automodel_llm.dflash.blocks import BlockLoss, Blocks, slot_positions, spark_candidates, spark_loss, spark_slots
from automodel_llm.dflash.recipe import BlockDraftRecipe, decay_words
from automodel_llm.dflash.settings import DSPARK_RECIPE_ARGS, DSparkConfig, spark_target_layers
from automodel_llm.dflash.spark import ARCHITECTURE, GEMMA4_TEXT_TYPES, DSparkDraftModel, spark_config
from automodel_llm.draft_recipe import model_hf_config

# model types (the target's and its text config's) for which upstream's DSpark builds a draft of another kind
_OTHER_DRAFTS = {
    "deepseek_v4": "DeepSeek V4's (V4 attention: Q-LoRA, a shared K=V latent, grouped O-LoRA)",
    "glm_moe_dsa": "GLM-5.2's (a dense MLA draft)",
    "kimi_k3": "Kimi K3's (a dense MLA draft)", "kimi_linear": "Kimi K3's (a dense MLA draft)",
    "minimax_m3_vl": "MiniMax M3's", "minimax_m3": "MiniMax M3's",
}


class DSparkRecipe(BlockDraftRecipe):
    """Trains a DSpark draft (a parallel backbone, a serial Markov head and a confidence head) for a frozen
    target."""

    settings_key = "dspark"
    name = "DSpark"
    served_by = "an engine with DSpark drafting (upstream names SGLang's runtime and its own spec_generate)"
    loss_description = "DSpark's decay-weighted cross entropy, L1 distance to the target and confidence loss"
    sections: ClassVar[dict] = {"dspark": DSparkConfig, "recipe_args": DSPARK_RECIPE_ARGS}

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg))
        settings = cfg.get(cls.settings_key)
        strategy = getattr(cfg.get("distributed"), "strategy", None)
        if settings is not None and settings.shard_dense_target is True and strategy != "fsdp2":
            issues.append(ConfigIssue(f"{cls.settings_key}.shard_dense_target", f"true splits the target with "
                                      f"FSDP2, and distributed.strategy is {strategy!r}: set strategy: fsdp2, or "
                                      "leave it unset"))
        target = model_hf_config(cfg)
        if target is not None and (why := other_draft(target)):
            issues.append(ConfigIssue("model", why))
        return issues

    default_layers = staticmethod(spark_target_layers)
    architecture: str = ARCHITECTURE  # the draft's (its config's architectures)

    @classmethod
    def target_issues(cls, settings: DSparkConfig, text: Any) -> list[ConfigIssue]:
        issues = super().target_issues(settings, text)
        if getattr(text, "model_type", None) in GEMMA4_TEXT_TYPES:
            for key in ("draft_sliding_window", "draft_num_attention_heads", "draft_num_key_value_heads",
                        "draft_head_dim"):
                if getattr(settings, key) is not None:
                    issues.append(ConfigIssue(f"{cls.settings_key}.{key}", "the Gemma 4 draft's layers are the "
                                              "target's full-attention layers, their sizes the target's (upstream's "
                                              "Gemma4DSparkModel): remove it"))
        return issues

    @classmethod
    def loss_words(cls, settings: DSparkConfig) -> str:
        confidence = (f" + {settings.confidence_head_alpha} x confidence BCE" if settings.confidence_head else "")
        markov = (f"{settings.markov_head_type} Markov head of rank {settings.markov_rank}" if settings.markov_rank
                  else "no Markov head")
        return (f"{settings.ce_loss_alpha} x CE + {settings.l1_loss_alpha} x L1 to the target{confidence}"
                f"{decay_words(settings)}; {markov}")

    def make_draft(self, text: Any, settings: DSparkConfig) -> torch.nn.Module:
        """The draft, its embeddings and output head copies of the target's (frozen unless ``freeze_embeddings:
        false``)."""
        if why := other_draft(self.target.config):
            raise AutomodelError(f"model: {why}")
        if text.model_type in GEMMA4_TEXT_TYPES:
            from automodel_llm.dflash.spark_gemma4 import Gemma4DSparkDraftModel, gemma4_spark_config

            kind = self.target.config.model_type
            draft = Gemma4DSparkDraftModel(gemma4_spark_config(text, settings, self.target_layer_ids, kind))
            self.architecture = draft.config.architectures[0]
        elif self.embedding_scale is not None or self.head_bias is not None:
            raise AutomodelError(f"model: the target {self.target_class} scales its embeddings or biases its output "
                                 "head, which DSpark's draft (a plain embedding and head) does not reproduce")
        else:
            draft = DSparkDraftModel(spark_config(text, settings, self.target_layer_ids))
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(self.embedding_weight)
            draft.lm_head.weight.copy_(self.head_weight)
        draft.embed_tokens.requires_grad_(not settings.freeze_embeddings)
        draft.lm_head.requires_grad_(not settings.freeze_embeddings)
        del self.embedding_weight, self.head_weight  # the draft holds its own copies
        return draft

    def shards_target(self) -> bool:
        return self.settings().shard_dense_target is not False

    def candidates(self, supervised: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return spark_candidates(supervised, lengths)

    def slot_weights(self, ids: torch.Tensor, supervised: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        settings: DSparkConfig = self.settings()
        return spark_slots(ids, supervised, blocks, settings.block_size, settings.loss_decay_gamma)[2]

    def block_inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"block_ids": tokens}

    def extra_inputs(self, ids: torch.Tensor, blocks: Blocks) -> dict[str, torch.Tensor]:
        """The row's token before the one each slot drafts (the Markov head's input: teacher forcing)."""
        at = slot_positions(blocks, self.settings().block_size).flatten(1).clamp(max=ids.shape[1] - 1)
        return {"previous_ids": torch.gather(ids, 1, at)}

    def blocks_loss(self, output: Any, target_logits: torch.Tensor, ids: torch.Tensor, supervised: torch.Tensor,
                    blocks: Blocks, training: bool) -> BlockLoss:
        settings: DSparkConfig = self.settings()
        logits, confidence = output
        return spark_loss(logits, confidence, target_logits, ids, supervised, blocks, settings.block_size,
                          settings.loss_decay_gamma, settings.ce_loss_alpha, settings.l1_loss_alpha,
                          settings.confidence_head_alpha)

    def metrics_of(self, counts: torch.Tensor) -> dict[str, float]:
        """DFlash's, and ``expected_accept_length`` (per block) and ``confidence_error`` (the confidence head's mean
        absolute error over the drafted slots; with a confidence head)."""
        _, counted, _, blocks, expected, error = counts
        metrics = {**super().metrics_of(counts), "expected_accept_length": (expected / blocks.clamp_min(1)).item()}
        if self.settings().confidence_head:
            metrics["confidence_error"] = (error / counted.clamp_min(1)).item()
        return metrics

    def final_message(self, model_dir: Any) -> str:
        if not model_dir.is_dir():
            return super().final_message(model_dir)
        return (f"the DSpark draft is in {model_dir} ({self.architecture}, upstream's layout, with its own embeddings, "
                f"output head, Markov and confidence heads): serve it as the speculative model of its target "
                f"({self.served_by})")


def gemma4_issue(text: Any) -> str | None:
    """Why the Gemma 4 draft cannot be made for the target's text config ``text`` (None: it can)."""
    if getattr(text, "enable_moe_block", False):
        return ("a Gemma 4 mixture-of-experts target: upstream's Gemma 4 DSpark draft is dense and refuses its "
                "expert blocks (enable_moe_block)")
    if getattr(text, "hidden_size_per_layer_input", 0):
        return ("a Gemma 4 target with per-layer inputs (hidden_size_per_layer_input, the E2B / E4B models), which "
                "upstream's Gemma 4 DSpark draft refuses")
    return None


def other_draft(target: Any) -> str | None:
    """Why DSpark's Qwen3-style draft is not the one for ``target`` (an HF config), None when it is."""
    text = target.get_text_config() if hasattr(target, "get_text_config") else target
    if getattr(text, "model_type", None) in GEMMA4_TEXT_TYPES:
        return gemma4_issue(text)
    for config in (target, text):
        kind = getattr(config, "model_type", None)
        if kind in _OTHER_DRAFTS:
            return (f"a {kind} target: upstream drafts it with {_OTHER_DRAFTS[kind]} DSpark draft, which is not "
                    f"built here; the draft here is upstream's Qwen3-style one ({ARCHITECTURE}), for Qwen3 and "
                    "other decoders with plain embeddings")
    return None
