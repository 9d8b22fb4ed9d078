"""The EAGLE-1 / EAGLE-2 draft model (arXiv 2401.15077, 2406.16858; EAGLE-2 drafts a dynamic tree at serving time
with the same draft): Llama decoder layers that read, at each position, the embedding of the next token beside the
target model's last hidden state (its feature) and predict the target's feature one position on, which the target's
own output head turns into the drafted token's distribution.

The layout is the one the serving engines load an EAGLE draft in (EAGLE's reference ``cnets.py``, vLLM's
``EagleLlamaForCausalLM``, SGLang's ``LlamaForCausalLMEagle``): ``embed_tokens``, ``fc`` (the embedding and the
feature side by side, ``2 x hidden_size`` -> ``hidden_size``), ``layers.{i}.*`` whose first layer has no input norm,
and no final norm (the output is the predicted feature itself). ``fc.bias`` is zeros and never trained: vLLM's
``fc`` has no bias (it skips the tensor) and SGLang's has one (it reads the zeros), so both serve the same draft.
Upstream NeMo AutoModel's EAGLE-1/2 draft differs (a norm before the first layer and after the last, which vLLM
skips when loading); this one is the engines'.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from automodel_llm.eagle3.draft import TARGET_KEYS, DraftMLP, attention_heads
from automodel_llm.eagle3.unroll import documents

ARCHITECTURE = "EagleLlamaForCausalLM"  # what vLLM serves an EAGLE-1/2 draft as (SGLang: LlamaForCausalLMEagle)


def draft_config(target: Any, layers: int) -> LlamaConfig:
    """The draft's config from the target's (its text config for a multimodal one): the target's sizes and
    ``layers`` layers."""
    given = target.to_dict()
    keys = {k: given[k] for k in TARGET_KEYS if given.get(k) is not None}
    config = LlamaConfig(**{**keys, "num_hidden_layers": layers, "tie_word_embeddings": False})
    config.architectures = [ARCHITECTURE]
    return config


class DraftAttention(nn.Module):
    """Llama self-attention; ``visible`` (``[seq, seq]`` or ``[batch, 1, seq, seq]``, True where a position may
    look) is causal, and within each sample for packed rows."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                visible: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden.shape
        out = nn.functional.scaled_dot_product_attention(*attention_heads(self, hidden, rotary), attn_mask=visible)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DraftLayer(nn.Module):
    """A pre-norm Llama decoder layer; the first layer of the draft has no input norm (its input is ``fc``'s)."""

    def __init__(self, config: LlamaConfig, first: bool):
        super().__init__()
        self.input_layernorm = nn.Identity() if first else LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                visible: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, visible)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleLlamaForCausalLM(PreTrainedModel):
    """The draft: ``forward`` maps the tokens and the target's features at each position to the predicted feature
    of the next position."""

    config_class = LlamaConfig
    base_model_prefix = ""
    generates = False  # it drafts beside its target; it does not generate text alone
    _no_split_modules = ["DraftLayer"]
    _supports_sdpa = True

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layers = nn.ModuleList(DraftLayer(config, first=i == 0) for i in range(config.num_hidden_layers))
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.post_init()
        with torch.no_grad():
            self.fc.bias.zero_()
        self.fc.bias.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``[batch, seq]`` (the token after each position) and ``features`` ``[batch, seq, hidden]``
        (the target's last hidden state at each position) -> the predicted feature of the next position. Packed rows
        (``position_ids`` restarting at 0 for each sample) attend within their own sample."""
        features = features.to(self.fc.weight.dtype)
        hidden = self.fc(torch.cat([self.embed_tokens(input_ids).to(features.dtype), features], dim=-1))
        length = input_ids.shape[1]
        visible = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand_as(input_ids)
        else:
            docs = documents(position_ids)
            visible = visible & (docs[:, None, :, None] == docs[:, None, None, :])
        rotary = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, rotary, visible)
        return hidden
