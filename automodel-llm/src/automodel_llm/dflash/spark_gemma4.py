"""DSpark's draft for Gemma 4 targets (upstream's ``Gemma4DSparkModel``): the backbone is made of Gemma 4's own
pieces, as the target's layers are. Each layer is a full-attention Gemma 4 layer (query, key and value norms, the
value norm without a scale, attention scale 1, keys as values where the target's full layers share them:
``attention_k_eq_v``; the target's full-attention head size and key/value heads; its proportional partial rotary;
the norms after attention and around the MLP; a ``layer_scalar``) whose keys and values are ``[context | block]``
as in :class:`~automodel_llm.dflash.draft.DFlashAttention`. The embeddings are scaled by ``sqrt(hidden_size)`` and
the logits soft-capped as the target's (``final_logit_softcapping``); the Markov and confidence heads are
:mod:`automodel_llm.dflash.spark`'s.

The config is the target's text config (``Gemma4TextConfig``) cut to the draft's layers, all ``full_attention``,
with DSpark's keys at its top, ``architectures: [Gemma4DSparkModel]``, ``target_model_type``, and the full-attention
sizes also as ``global_head_dim`` / ``num_global_key_value_heads`` (how Gemma 4's published configs name them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4PreTrainedModel,
    Gemma4RMSNorm,
    Gemma4TextMLP,
    Gemma4TextRotaryEmbedding,
    Gemma4TextScaledWordEmbedding,
    apply_rotary_pos_emb,
)

from automodel_llm.dflash.draft import block_attention
from automodel_llm.dflash.settings import DSparkConfig
from automodel_llm.dflash.spark import GEMMA4_ARCHITECTURE as ARCHITECTURE
from automodel_llm.dflash.spark import SparkOutputs, with_spark_keys

_DROPPED = ("per_layer_config", "layer_types", "num_hidden_layers", "architectures", "transformers_version",
            "model_type", "dtype", "num_kv_shared_layers", "tie_word_embeddings", "use_bidirectional_attention",
            "global_head_dim", "num_global_key_value_heads")


def gemma4_spark_config(text: Any, settings: DSparkConfig, target_layer_ids: list[int], target_type: str
                        ) -> Gemma4TextConfig:
    """The draft's config from the target's Gemma 4 text config."""
    full = text.per_layer_config[text.layer_types.index("full_attention")]
    layers = settings.draft_num_hidden_layers
    given = {key: value for key, value in text.to_dict().items() if key not in _DROPPED}
    shared_kv = bool(getattr(text, "attention_k_eq_v", False))
    config = Gemma4TextConfig(**given, num_hidden_layers=layers, layer_types=["full_attention"] * layers,
                              global_head_dim=full.head_dim, tie_word_embeddings=False, num_kv_shared_layers=0,
                              num_global_key_value_heads=full.num_key_value_heads if shared_kv else None)
    config.global_head_dim = full.head_dim
    config.num_global_key_value_heads = full.num_key_value_heads
    config.num_target_layers = text.num_hidden_layers
    config.target_model_type = target_type
    config._attn_implementation = settings.attention_backend
    return with_spark_keys(config, settings, target_layer_ids, ARCHITECTURE)


class Gemma4SparkAttention(nn.Module):
    """A Gemma 4 full-attention layer's attention over ``[context | block]`` keys and values."""

    def __init__(self, config: Gemma4TextConfig, index: int):
        super().__init__()
        sizes = config.per_layer_config[index]
        self.head_dim, self.heads, self.kv_heads = sizes.head_dim, config.num_attention_heads, sizes.num_key_value_heads
        self.implementation = config._attn_implementation
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = None if config.attention_k_eq_v else nn.Linear(config.hidden_size,
                                                                     self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, eps=config.rms_norm_eps, with_scale=False)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Any) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        both = torch.cat([context, hidden], dim=1)
        keys = self.k_proj(both).view(batch, both.shape[1], self.kv_heads, self.head_dim)
        values = keys if self.v_proj is None else self.v_proj(both).view_as(keys)
        q = self.q_norm(self.q_proj(hidden).view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        k, v = self.k_norm(keys).transpose(1, 2), self.v_norm(values).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos[:, -length:], sin[:, -length:], unsqueeze_dim=1)
        k = apply_rotary_pos_emb(k, cos, sin, unsqueeze_dim=1)
        out = block_attention(q, k, v, mask, self.implementation, 1.0)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Gemma4SparkLayer(nn.Module):
    def __init__(self, config: Gemma4TextConfig, index: int):
        super().__init__()
        self.input_layernorm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Gemma4SparkAttention(config, index)
        self.post_attention_layernorm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Gemma4TextMLP(config, index)
        self.post_feedforward_layernorm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Any) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), context, cos, sin, mask)
        hidden = hidden + self.post_attention_layernorm(attended)
        hidden = hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden * self.layer_scalar


class Gemma4DSparkDraftModel(SparkOutputs, Gemma4PreTrainedModel):
    """The Gemma 4 draft: the same forward as :class:`~automodel_llm.dflash.spark.DSparkDraftModel`."""

    config_class = Gemma4TextConfig
    base_model_prefix = ""
    _no_split_modules = ["Gemma4SparkLayer"]

    def __init__(self, config: Gemma4TextConfig):
        super().__init__(config)
        self.target_layer_ids = list(config.target_layer_ids)
        self.block_size, self.mask_token_id = config.block_size, config.mask_token_id
        self.embed_tokens = Gemma4TextScaledWordEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id,
                                                          embed_scale=config.hidden_size ** 0.5)
        self.layers = nn.ModuleList(Gemma4SparkLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.add_spark_heads(config)
        # made on first use, in float32 (as DFlashDraftModel's): not a registered module a cast would round
        self._rotary: tuple[Gemma4TextRotaryEmbedding, ...] = ()
        self.post_init()

    def rotary(self, device: torch.device) -> Gemma4TextRotaryEmbedding:
        if not self._rotary or self._rotary[0].full_attention_inv_freq.device != device:
            self._rotary = (Gemma4TextRotaryEmbedding(self.config).to(device),)
        return self._rotary[0]

    def forward(self, block_ids: torch.Tensor, target_states: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Any, previous_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        context = self.hidden_norm(self.fc(target_states.to(self.fc.weight.dtype)))
        hidden = self.embed_tokens(block_ids).to(context.dtype)
        cos, sin = self.rotary(hidden.device)(hidden.float(), position_ids, "full_attention")
        cos, sin = cos.to(hidden.dtype), sin.to(hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, attention_mask)
        return self.spark_outputs(self.norm(hidden), previous_ids)
