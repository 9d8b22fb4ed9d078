"""The DSpark draft model (semi-autoregressive block drafting): DFlash's parallel backbone drafts a whole block in one
forward, a light serial Markov head adds to each slot's logits a bias from the token before it (so a block's drafts
depend on each other at almost no cost), and a confidence head predicts each drafted token's acceptance
probability (for scheduled verification).

Unlike DFlash's, slot ``k`` of a block drafts the token at ``anchor + 1 + k`` (the anchor's slot drafts too), and
the draft owns its embeddings and output head (copies of the target's, frozen unless ``freeze_embeddings: false``).
Weights and config are named as upstream's ``Qwen3DSparkModel``: DFlash's backbone keys beside ``embed_tokens``,
``lm_head``, ``markov_head.{markov_w1, markov_w2, gate_proj, joint_proj}`` and ``confidence_head.proj``; the config
a Qwen3 one with ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_target_layers``, ``num_anchors``,
``markov_rank``, ``markov_head_type``, ``enable_confidence_head`` and ``confidence_head_with_markov`` at its top.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Qwen3Config

from automodel_llm.dflash.draft import DFlashDraftModel, draft_config
from automodel_llm.dflash.settings import DSparkConfig

ARCHITECTURE = "Qwen3DSparkModel"  # upstream's DSpark draft of Qwen3-style targets
# upstream's DSpark draft of Gemma 4 targets (automodel_llm.dflash.spark_gemma4, which needs transformers' Gemma 4),
# and the target text configs it is made for
GEMMA4_ARCHITECTURE = "Gemma4DSparkModel"
GEMMA4_TEXT_TYPES = ("gemma4_text", "gemma4_unified_text")


def spark_config(target: Any, settings: DSparkConfig, target_layer_ids: list[int]) -> Qwen3Config:
    """The draft's config from the target's text config and the ``dspark`` settings."""
    config = draft_config(target, settings.draft_num_hidden_layers, settings.block_size, settings.mask_token_id,
                          target_layer_ids, settings.attention_backend, settings.draft_sliding_window,
                          settings.draft_num_attention_heads, settings.draft_num_key_value_heads,
                          settings.draft_head_dim)
    del config.dflash_config  # DSpark's keys stand at the config's top
    return with_spark_keys(config, settings, target_layer_ids, ARCHITECTURE)


def with_spark_keys(config: Any, settings: DSparkConfig, target_layer_ids: list[int], architecture: str) -> Any:
    """``config`` with DSpark's keys at its top (upstream's layout) and ``architecture``."""
    config.architectures = [architecture]
    config.block_size = settings.block_size
    config.mask_token_id = settings.mask_token_id
    config.target_layer_ids = list(target_layer_ids)
    config.num_anchors = settings.num_anchors
    config.markov_rank = settings.markov_rank
    if settings.markov_rank:
        config.markov_head_type = settings.markov_head_type
    config.enable_confidence_head = settings.confidence_head
    if settings.confidence_head:
        config.confidence_head_with_markov = settings.confidence_head_with_markov
    return config


class VanillaMarkov(nn.Module):
    """The bias of a slot's logits from the token before it: ``markov_w2(markov_w1[previous])`` (rank ``r``)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, logits: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[batch, n, block, vocab]`` plus each slot's bias; ``previous`` ``[batch, n, block]``: the
        token before each slot's; ``hidden``: the slots' states."""
        return logits + self.markov_w2(self.markov_w1(previous))


class GatedMarkov(VanillaMarkov):
    """The vanilla bias with the previous token's embedding gated by the slot's state."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def forward(self, logits: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embedded = self.markov_w1(previous)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)))
        return logits + self.markov_w2(gate.to(embedded.dtype) * embedded)


class RecurrentMarkov(VanillaMarkov):
    """A recurrent state over the block's earlier tokens (a gated update from the previous token's embedding and
    the slot's state, zero before the first slot), projected to the bias."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def forward(self, logits: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embedded = self.markov_w1(previous).to(hidden.dtype)
        state = hidden.new_zeros(*hidden.shape[:-2], embedded.shape[-1])
        biased = []
        for slot in range(logits.shape[-2]):
            joint = self.joint_proj(torch.cat([state, embedded[..., slot, :], hidden[..., slot, :]], dim=-1))
            gate, candidate, output = joint.chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            biased.append(logits[..., slot, :] + self.markov_w2(torch.tanh(output).to(self.markov_w2.weight.dtype)))
        return torch.stack(biased, dim=-2)


class AcceptancePredictor(nn.Module):
    """The confidence head: one logit per drafted slot, the predicted probability that the verifier accepts it."""

    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


def markov_head(config: Qwen3Config) -> VanillaMarkov | None:
    """The config's Markov head (None with ``markov_rank`` 0)."""
    if not config.markov_rank:
        return None
    if config.markov_head_type == "vanilla":
        return VanillaMarkov(config.vocab_size, config.markov_rank)
    kind = GatedMarkov if config.markov_head_type == "gated" else RecurrentMarkov
    return kind(config.vocab_size, config.markov_rank, config.hidden_size)


class SparkOutputs:
    """A DSpark draft's own output head, Markov head and confidence head (a mix-in of the draft modules)."""

    block_size: int
    embed_tokens: nn.Embedding

    def add_spark_heads(self, config: Any) -> list[nn.Module]:
        """The heads of ``config``; the modules made (the caller initialises them)."""
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.markov_head = markov_head(config)
        self.confidence_head_with_markov = bool(config.enable_confidence_head and
                                                config.confidence_head_with_markov)
        self.confidence_head = None
        if config.enable_confidence_head:
            extra = config.markov_rank if self.confidence_head_with_markov else 0
            self.confidence_head = AcceptancePredictor(config.hidden_size + extra)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        return [m for m in (self.lm_head, self.markov_head, self.confidence_head) if m is not None]

    def spark_outputs(self, hidden: torch.Tensor, previous_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits ``[batch, n, block, vocab]`` (float32; the target's final soft cap, then the Markov head's
        bias) and the confidence head's logits ``[batch, n, block]`` (None without one) of the block slots'
        ``hidden`` states ``[batch, q, size]``."""
        batch, length, size = hidden.shape
        shape = (batch, length // self.block_size, self.block_size)
        hidden = hidden.view(*shape, size)
        previous_ids = previous_ids.view(shape)
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.markov_head is not None:
            logits = self.markov_head(logits, previous_ids, hidden)
        if self.confidence_head is None:
            return logits, None
        features = hidden
        if self.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.markov_w1(previous_ids).to(hidden.dtype)], dim=-1)
        return logits, self.confidence_head(features).float()


class DSparkDraftModel(SparkOutputs, DFlashDraftModel):
    """The draft: ``forward(block_ids, target_states, position_ids, attention_mask, previous_ids)`` gives the
    blocks' logits and confidence logits (:meth:`SparkOutputs.spark_outputs`)."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        for module in (self.embed_tokens, *self.add_spark_heads(config)):
            module.apply(self._init_weights)  # the base's post_init ran before these existed

    def forward(self, block_ids: torch.Tensor, target_states: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Any, previous_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``block_ids`` ``[batch, q]``: the blocks' tokens (anchor, then mask tokens); ``previous_ids``
        ``[batch, q]``: the row's token before the one each slot drafts (teacher forcing: the anchor, then the
        data's)."""
        hidden = super().forward(self.embed_tokens(block_ids), target_states, position_ids, attention_mask)
        return self.spark_outputs(hidden, previous_ids)
