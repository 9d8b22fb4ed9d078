"""The EAGLE-3 draft model (arXiv 2503.01840): one Llama-style decoder layer that reads the target model's hidden
states of three of its layers and the embedding of the next token, and predicts the token after it over a smaller
draft vocabulary.

The weights are named as SGLang's and vLLM's ``LlamaForCausalLMEagle3`` loaders read them from a directory (the
layout of the EAGLE-3 authors' and SpecForge's drafts): ``embed_tokens``, ``fc`` (the fused target states,
``3 x target_hidden_size`` -> ``hidden_size``), ``midlayer.{input_layernorm, hidden_norm, self_attn.*,
post_attention_layernorm, mlp.*}``, ``norm``, ``lm_head`` (``hidden_size`` -> ``draft_vocab_size``), and the
vocabulary maps ``d2t`` (a draft id ``i`` is target id ``i + d2t[i]``) and ``t2d`` (whether a target id is in the
draft vocabulary). Both loaders add their own ``model.`` to every name but ``lm_head`` and the maps (upstream NeMo
AutoModel saves its ``model.``-prefixed names and strips them in an export step; these need none). EAGLE-3.1's
``fc_norm`` (an RMSNorm per fused state, ``fc_norm.{0,1,2}``) and ``norm_output`` (the carried hidden state is the
normed one) are options of the config.

Training-time test: step ``k`` of the unroll feeds the draft its own hidden states of step ``k - 1``; its attention
sees the step-0 keys causally and, at its own position only, the keys of steps ``1..k``
(:func:`unrolled_attention`), which is what the draft sees when it drafts ``k + 1`` tokens ahead at serving time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from automodel_llm.eagle3.unroll import UnrollSums, unroll

ARCHITECTURE = "LlamaForCausalLMEagle3"  # what SGLang and vLLM serve an EAGLE-3 draft as
AUX_STATES = 3  # EAGLE-3 fuses the target's low, middle and high layers
# what the draft takes of the target's config: its sizes, activation, norm, positions and special tokens (not the
# per-layer keys of a hybrid, the experts of a mixture, ...)
TARGET_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta",
               "rope_scaling", "attention_bias", "mlp_bias", "initializer_range", "pad_token_id", "bos_token_id",
               "eos_token_id", "dtype")


def draft_config(target: Any, draft_vocab_size: int, aux_layer_ids: list[int], attention: str,
                 fc_norm: bool, norm_output: bool, parallel: dict[str, Any] | None = None) -> LlamaConfig:
    """The draft's config from the target's (its text config for a multimodal one): the target's sizes, one layer,
    the draft vocabulary, and the serving keys (``eagle_aux_hidden_state_layer_ids`` counts as vLLM does: the
    hidden state entering layer ``i``, so the output of layer ``i - 1``). ``parallel``: P-EAGLE's keys
    (``num_hidden_layers``, ``mask_token_id``, ``num_depths``, the COD ratios), saved with ``parallel_drafting``."""
    given = target.to_dict()
    keys = {k: given[k] for k in TARGET_KEYS if given.get(k) is not None}
    served_ids = [i + 1 for i in aux_layer_ids]
    config = LlamaConfig(**{**keys, "num_hidden_layers": 1, "tie_word_embeddings": False,
                            "draft_vocab_size": draft_vocab_size, "target_hidden_size": target.hidden_size,
                            "num_aux_hidden_states": AUX_STATES, "fc_norm": fc_norm, "norm_output": norm_output,
                            "eagle_aux_hidden_state_layer_ids": served_ids,
                            "eagle_config": {"eagle_aux_hidden_state_layer_ids": served_ids,
                                             "use_aux_hidden_state": True},
                            **({"parallel_drafting": True, **parallel} if parallel else {})})
    config.architectures = [ARCHITECTURE]
    config._attn_implementation = attention
    return config


def unrolled_attention(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       implementation: str, visible: torch.Tensor) -> torch.Tensor:
    """Attention of step ``len(keys) - 1`` of the unroll (``[batch, heads, seq, dim]`` each): every position sees
    the step-0 keys ``visible`` allows it (``[seq, seq]`` or ``[batch, 1, seq, seq]``: causal, within its own
    document when rows are packed) and its own keys of the later steps. ``eager`` computes the scores by hand,
    ``sdpa`` through torch's kernel with the same mask over the steps' keys laid end to end."""
    length = query.shape[-2]
    scale = query.shape[-1] ** -0.5
    if implementation == "sdpa":
        diagonal = torch.eye(length, dtype=torch.bool, device=query.device).expand_as(visible)
        mask = torch.cat([visible] + [diagonal] * (len(keys) - 1), dim=-1)
        return nn.functional.scaled_dot_product_attention(query, torch.cat(keys, dim=-2), torch.cat(values, dim=-2),
                                                          attn_mask=mask, scale=scale)
    scores = (query @ keys[0].transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    own = [(query * key).sum(-1, keepdim=True) * scale for key in keys[1:]]
    weights = torch.softmax(torch.cat([scores, *own], dim=-1).float(), dim=-1).to(query.dtype)
    out = weights[..., :length] @ values[0]
    for step, value in enumerate(values[1:]):
        out = out + weights[..., length + step:length + step + 1] * value
    return out


def attention_heads(attention: nn.Module, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rotated query and key and the value of ``hidden`` (``[batch, heads, seq, head_dim]`` each, the key and
    value repeated for grouped-query attention) by ``attention``'s ``q_proj`` / ``k_proj`` / ``v_proj``."""
    batch, length, _ = hidden.shape
    shape = (batch, length, -1, attention.head_dim)
    query = attention.q_proj(hidden).view(shape).transpose(1, 2)
    key = attention.k_proj(hidden).view(shape).transpose(1, 2)
    value = attention.v_proj(hidden).view(shape).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, *rotary)
    repeat = attention.heads // attention.kv_heads
    return query, key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)


class DraftAttention(nn.Module):
    """Llama attention over ``inputs x hidden_size`` inputs (2: the token's embedding and the carried hidden state;
    1: a P-EAGLE draft's later layers)."""

    def __init__(self, config: LlamaConfig, inputs: int = 2):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = getattr(config, "attention_bias", False)
        width = inputs * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                past: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], visible: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's output, key and value (``past``: the keys and values of the steps before; not changed, so
        that activation checkpointing can run the step again)."""
        batch, length, _ = hidden.shape
        query, key, value = attention_heads(self, hidden, rotary)
        out = unrolled_attention(query, [*past[0], key], [*past[1], value], self.config._attn_implementation,
                                 visible)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), key, value


class DraftMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden)) * self.up_proj(hidden))


class DraftLayer(nn.Module):
    """The draft's decoder layer: the normed embedding and the normed carried state side by side into attention,
    the carried state as the residual."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                past: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], visible: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's output state, key and value (a function of its inputs alone: activation checkpointing runs it
        again in the backward pass)."""
        both = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attended, key, value = self.self_attn(both, rotary, past, visible)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), key, value


class PlainLayer(nn.Module):
    """A P-EAGLE draft's layer after the first: a Llama decoder layer over the carried state alone."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, inputs=1)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], visible: torch.Tensor
                ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, ((), ()), visible)[0]
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLMEagle3(PreTrainedModel):
    """The draft. :meth:`fuse` turns the target's three hidden states into the first carried state;
    :meth:`forward` is one step of the unroll (the caller keeps ``cache`` across the steps of one batch)."""

    config_class = LlamaConfig
    base_model_prefix = ""
    generates = False  # LoRA wraps it in peft's task-agnostic PeftModel (automodel.hf.lora_task_type)
    _no_split_modules = ["DraftLayer"]
    _supports_sdpa = True
    # the draft's one layer is its transformer block (an FSDP2 unit, and what activation checkpointing recomputes),
    # not the ModuleList of EAGLE-3.1's fc_norm
    transformer_block_names = ("midlayer",)

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        target_hidden = config.target_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(AUX_STATES * target_hidden, config.hidden_size, bias=False)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(target_hidden, eps=config.rms_norm_eps)
                                         for _ in range(AUX_STATES))
        self.midlayer = DraftLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        if getattr(config, "parallel_drafting", False):  # P-EAGLE: more layers, the masked slots' placeholder state
            self.layers = nn.ModuleDict({str(i): PlainLayer(config) for i in range(1, config.num_hidden_layers)})
            self.mask_hidden = nn.Parameter(torch.empty(1, 1, AUX_STATES * target_hidden))
            self.transformer_block_names = ("midlayer", *(f"layers.{i}" for i in self.layers))
        self.post_init()
        if getattr(config, "parallel_drafting", False):
            nn.init.normal_(self.mask_hidden)  # unit variance, as speculators' (not the weights' 0.02)

    def set_vocabulary(self, token_ids: torch.Tensor) -> None:
        """The draft vocabulary: ``token_ids`` (sorted target ids), as ``d2t`` offsets and the ``t2d`` mask."""
        with torch.no_grad():
            ids = token_ids.to(self.d2t.device, torch.long)
            self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True

    def draft_token_ids(self) -> torch.Tensor:
        """The target id of each draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def fuse(self, aux_states: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, 3 x target_hidden]`` -> the first carried state ``[batch, seq, hidden]``."""
        if self.config.fc_norm:
            parts = aux_states.chunk(AUX_STATES, dim=-1)
            aux_states = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return self.fc(aux_states)

    def forward(self, input_ids: torch.Tensor, supervised: torch.Tensor, aux_states: torch.Tensor,
                target_logits: torch.Tensor, steps: int, position_ids: torch.Tensor | None = None,
                elements: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> UnrollSums:
        """The training-time-test unroll of one batch (:func:`~automodel_llm.eagle3.unroll.unroll`), or with
        ``elements`` (each row's COD-sampled anchors and depths) P-EAGLE's parallel drafting
        (:func:`~automodel_llm.eagle3.parallel.parallel_sums`), in one call of the module so that DDP and FSDP2 see
        one forward per backward."""
        if elements is not None:
            from automodel_llm.eagle3.parallel import parallel_sums

            return parallel_sums(self, input_ids, supervised, aux_states, target_logits, elements)
        return unroll(self, input_ids, supervised, aux_states, target_logits, steps, position_ids)

    def parallel(self, input_ids: torch.Tensor, states: torch.Tensor, position_ids: torch.Tensor,
                 visible: torch.Tensor) -> torch.Tensor:
        """P-EAGLE's one forward over a row's flat COD sequence (``[1, n]`` tokens, ``[1, n, hidden]`` fused
        states, positions, ``[1, 1, n, n]`` visibility): the logits over the draft vocabulary."""
        embeds = self.embed_tokens(input_ids).to(states.dtype)
        rotary = self.rotary_emb(states, position_ids)
        hidden = self.midlayer(embeds, states, rotary, ((), ()), visible)[0]
        for layer in self.layers.values():
            hidden = layer(hidden, rotary, visible)
        return self.lm_head(self.norm(hidden))

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
             cache: tuple[list[torch.Tensor], list[torch.Tensor]], visible: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: ``(logits over the draft vocabulary, the state the next step carries)``."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        rotary = self.rotary_emb(hidden, position_ids)
        hidden, key, value = self.midlayer(embeds, hidden, rotary, (tuple(cache[0]), tuple(cache[1])), visible)
        cache[0].append(key)
        cache[1].append(value)
        if self.config.norm_output:
            hidden = self.norm(hidden)
            return self.lm_head(hidden), hidden
        return self.lm_head(self.norm(hidden)), hidden
