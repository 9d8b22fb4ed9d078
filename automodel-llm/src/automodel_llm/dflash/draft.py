"""The DFlash draft model (block diffusion for speculative decoding, arXiv 2602.06036): a few Qwen3-style decoder
layers that draft a whole block of tokens in one forward. A block holds its anchor (a real token) and mask tokens;
its queries attend to the target model's states of the positions before the anchor (several target layers,
concatenated and projected by ``fc`` + ``hidden_norm``) and, both ways, to the block's own positions.

The weights and config are named as the published DFlash drafters' (``DFlashDraftModel``, a Qwen3 config with
``block_size``, ``num_target_layers`` and ``dflash_config: {block_size, mask_token_id, target_layer_ids}``):
``fc``, ``hidden_norm``, ``layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``. The draft has no embeddings and no output head: it
reads the target's (frozen), which the serving engine shares too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from automodel_llm.eagle3.draft import TARGET_KEYS

ARCHITECTURE = "DFlashDraftModel"  # the published DFlash drafters' architecture name


def draft_config(target: Any, layers: int, block_size: int, mask_token_id: int, target_layer_ids: list[int],
                 attention: str, sliding_window: int | None = None, heads: int | None = None,
                 kv_heads: int | None = None, head_dim: int | None = None,
                 head: dict[str, Any] | None = None) -> Qwen3Config:
    """The draft's config from the target's text config: its sizes (attention sized by ``heads`` / ``kv_heads`` /
    ``head_dim`` where given), ``layers`` non-causal layers (``sliding_attention`` with ``sliding_window``), and the
    serving keys; ``head``: the keys of a variant's modules, recorded in ``dflash_config`` (Domino's
    ``projector_type: domino``, ``emb_dim``, ... ; DFlash 2's ``conv_kernel_size``, ``selector_rank``, ...)."""
    given = target.to_dict()
    keys = {k: given[k] for k in TARGET_KEYS if given.get(k) is not None}
    for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        if value is not None:
            keys[key] = value
    keys.setdefault("head_dim", target.hidden_size // target.num_attention_heads)
    kind = "sliding_attention" if sliding_window is not None else "full_attention"
    config = Qwen3Config(**{**keys, "num_hidden_layers": layers, "tie_word_embeddings": False,
                            "layer_types": [kind] * layers, "sliding_window": sliding_window,
                            "use_sliding_window": sliding_window is not None, "max_window_layers": layers,
                            "is_causal": False, "num_target_layers": target.num_hidden_layers,
                            "block_size": block_size,
                            "dflash_config": {"block_size": block_size, "mask_token_id": mask_token_id,
                                              "target_layer_ids": list(target_layer_ids), **(head or {})}})
    config.architectures = [ARCHITECTURE]
    config._attn_implementation = attention
    return config


def block_settings(config: Qwen3Config) -> dict[str, Any]:
    """The draft's block keys: DFlash's ``dflash_config``, or DSpark's top-level ``block_size``, ``mask_token_id``
    and ``target_layer_ids`` (its published layout)."""
    settings = getattr(config, "dflash_config", None)
    if settings is not None:
        return settings
    return {key: getattr(config, key, None) for key in ("block_size", "mask_token_id", "target_layer_ids")}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Attention of the block's positions (queries) over the target's states before them and the block itself
    (keys and values: ``[context | block]``, both through the same projections); the mask says which of them each
    query sees."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.implementation = config._attn_implementation

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Any) -> torch.Tensor:
        """``hidden`` ``[batch, q, size]`` (the block positions), ``context`` ``[batch, c, size]``; ``cos`` /
        ``sin`` of the ``c + q`` key positions; ``mask``: boolean ``[batch, 1, q, c + q]`` (sdpa, eager) or a
        flex ``BlockMask``."""
        batch, length = hidden.shape[:2]
        both = torch.cat([context, hidden], dim=1)
        q = self.q_norm(self.q_proj(hidden).view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(batch, both.shape[1], self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(batch, both.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = _rotate(q, cos[..., -length:, :], sin[..., -length:, :]), _rotate(k, cos, sin)
        out = self.attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        return block_attention(q, k, v, mask, self.implementation, self.head_dim ** -0.5)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, implementation: str,
                    scale: float) -> torch.Tensor:
    """``[batch, heads, q, dim]`` queries over grouped keys and values, ``mask`` a boolean ``[batch, 1, q, k]``
    (sdpa, eager: the same numbers) or a flex ``BlockMask``."""
    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import flex_attention

        return _compiled(flex_attention)(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    if implementation == "sdpa":
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


_COMPILED: dict[Any, Any] = {}


def _compiled(function: Any) -> Any:
    """``function`` compiled once per process (flex attention's fused kernel exists only compiled)."""
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(function, dynamic=False)
    return _COMPILED[function]


class DynamicConv(nn.Module):
    """DFlash 2's two-tap dynamic depthwise convolution around one sublayer (before it and after it): output
    ``t`` is ``sum_j (base_kernel[j] + dynamic_t[j]) * x_{t - j}`` within a block (a block's first slots read zeros,
    never the previous block), the dynamic part predicted from the sublayer's input, one value per
    ``group_size`` channels. Made the identity (a unit tap on itself, no correction)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.kernel_projection.weight)
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0

    def taps(self, hidden: torch.Tensor) -> torch.Tensor:
        """The dynamic taps of both convolutions, from the sublayer's input: ``[..., 2, kernel, groups]``."""
        return self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, -1)

    def convolve(self, hidden: torch.Tensor, taps: torch.Tensor, which: int, block_size: int) -> torch.Tensor:
        """Convolution ``which`` (0 before the sublayer, 1 after) of ``hidden`` ``[batch, q, size]``."""
        batch, length, size = hidden.shape
        groups = size // self.group_size
        x = hidden.view(batch, length // block_size, block_size, groups, self.group_size)
        dynamic = taps[..., which, :, :].reshape(batch, length // block_size, block_size, self.kernel_size, groups, 1)
        out = torch.zeros_like(x)
        for offset in range(self.kernel_size):
            earlier = x if offset == 0 else F.pad(x[:, :, :-offset], (0, 0, 0, 0, offset, 0))
            kernel = self.base_kernel[which, offset].view(groups, self.group_size).to(x.dtype)
            out = out + (kernel + dynamic[:, :, :, offset]) * earlier
        return out.view(batch, length, size)


class CandidateSelector(nn.Module):
    """DFlash 2's pairwise path selector: the score of candidate ``b`` after token ``a`` at a slot with state ``h``
    is the draft's logit of ``b`` plus ``<predecessor_codebook[a] * hidden_projection(h), successor_codebook[b]>``.
    Made a no-op (a zero successor codebook)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.predecessor_codebook.normal_(mean=0.0, std=0.02)
            self.successor_codebook.zero_()

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor, predecessors: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(candidates, scores)`` ``[..., top_k]``: each slot's ``top_k`` tokens by ``logits`` and their scores
        after the token ``predecessors`` names."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        gate = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)
        pairwise = torch.einsum("...r,...kr->...k", gate, F.embedding(candidates, self.successor_codebook))
        return candidates, unary + pairwise


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        settings = block_settings(config)
        self.block_size = settings["block_size"]
        if "conv_kernel_size" in settings:  # DFlash 2: a dynamic convolution around each sublayer
            kernel, group = settings["conv_kernel_size"], settings["conv_group_size"]
            self.attention_conv = DynamicConv(config.hidden_size, kernel, group)
            self.mlp_conv = DynamicConv(config.hidden_size, kernel, group)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Any) -> torch.Tensor:
        hidden = hidden + self.around(getattr(self, "attention_conv", None), self.input_layernorm(hidden),
                                      lambda x: self.self_attn(x, context, cos, sin, mask))
        return hidden + self.around(getattr(self, "mlp_conv", None), self.post_attention_layernorm(hidden),
                                    self.mlp)

    def around(self, conv: DynamicConv | None, x: torch.Tensor, sublayer: Any) -> torch.Tensor:
        """``sublayer(x)``, within ``conv`` (before and after) where the layer has one."""
        if conv is None:
            return sublayer(x)
        taps = conv.taps(x)
        return conv.convolve(sublayer(conv.convolve(x, taps, 0, self.block_size)), taps, 1, self.block_size)


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The draft: ``forward(block_embeddings, target_states, position_ids, attention_mask)`` gives the block
    positions' last hidden states (normed), which the target's output head turns into logits."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        settings = block_settings(config)
        self.target_layer_ids = list(settings["target_layer_ids"])
        self.block_size, self.mask_token_id = settings["block_size"], settings["mask_token_id"]
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.domino = settings.get("projector_type") == "domino"
        if self.domino:  # Domino's correction head: a GRU over the block's earlier tokens, a low-rank projection
            self.shift_label = bool(settings["shift_label"])
            prefix = int(settings["pure_draft_prefix_len"])
            self.correction_start = prefix if self.shift_label else 1 + prefix
            self.prefix_gru = nn.GRU(config.hidden_size, settings["gru_hidden_dim"], batch_first=True, bias=False)
            self.embed_proj = nn.Sequential(
                nn.Linear(config.hidden_size + settings["gru_hidden_dim"], settings["emb_dim"], bias=False),
                nn.SiLU(), nn.Linear(settings["emb_dim"], config.vocab_size, bias=False))
        if "selector_rank" in settings:  # DFlash 2's path selector
            self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size,
                                                        settings["selector_rank"], settings["selector_top_k"])
        # made on first use, not a registered module: a cast of the model to bfloat16 would round its float32
        # frequencies, which the serving engines keep in float32 (the positions' phases would drift from the
        # trained ones), and a model built on the meta device (from_pretrained) would have none to move
        self._rotary: tuple[Qwen3RotaryEmbedding, ...] = ()
        self.post_init()
        for module in self.modules():  # DFlash 2's modules start as the identity / a no-op (after post_init's init)
            if isinstance(module, (DynamicConv, CandidateSelector)):
                module.reset_parameters()

    def rotary(self, device: torch.device) -> Qwen3RotaryEmbedding:
        """The rotary embedding's tables on ``device``, in float32."""
        if not self._rotary or self._rotary[0].inv_freq.device != device:
            self._rotary = (Qwen3RotaryEmbedding(self.config).to(device),)
        return self._rotary[0]

    def forward(self, block_embeddings: torch.Tensor, target_states: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Any, previous_embeddings: torch.Tensor | None = None, output_head: Any = None,
                predecessors: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``block_embeddings`` ``[batch, q, size]``: the target's embeddings of the blocks' tokens (anchor or
        mask); ``target_states`` ``[batch, c, layers x size]``: the target layers' outputs, concatenated;
        ``position_ids`` ``[batch, c + q]``: the context's positions, then the blocks'. With Domino's head and
        ``previous_embeddings`` (the embeddings of the row's tokens at each block slot's position), also the
        correction of the logits of slots ``correction_start ..`` (``[batch, n, slots, vocab]``). With DFlash 2's
        selector, ``output_head`` (the target's, states to logits) and ``predecessors`` (``[batch, q]``: the token
        before each slot's), ``(hidden, logits, candidates, scores)``."""
        context = self.hidden_norm(self.fc(target_states.to(self.fc.weight.dtype)))
        hidden = block_embeddings.to(context.dtype)
        cos, sin = self.rotary(hidden.device)(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, attention_mask)
        hidden = self.norm(hidden)
        if output_head is not None:
            logits = output_head(hidden)
            return hidden, logits, *self.candidate_selector(hidden, logits, predecessors)
        if previous_embeddings is None:
            return hidden
        return hidden, self.correction(hidden, previous_embeddings.to(hidden.dtype))

    def correction(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Domino's logit correction of each block slot from ``correction_start`` on: the projection of the slot's
        state beside the GRU's state after the block's tokens before the one the slot drafts (slot ``k`` drafts the
        token at ``anchor + k``, or ``anchor + 1 + k`` with ``shift_label``)."""
        batch, length, size = hidden.shape
        block = self.block_size
        start = self.correction_start
        previous = previous.reshape(-1, block, size)
        if self.shift_label:  # slot k's earlier tokens: anchor .. anchor + k
            states = self.prefix_gru(previous)[0][:, start:]
        else:  # slot k's earlier tokens: anchor .. anchor + k - 1
            states = self.prefix_gru(previous[:, :block - 1])[0][:, start - 1:]
        slots = hidden.reshape(-1, block, size)[:, start:]
        corrected = self.embed_proj(torch.cat([slots, states], dim=-1))
        return corrected.view(batch, length // block, block - start, -1)
