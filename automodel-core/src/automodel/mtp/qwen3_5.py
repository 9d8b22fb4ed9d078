"""Qwen3.5 / Qwen3.6's MTP heads (transformers' ``Qwen3_5ForConditionalGeneration`` and its MoE sibling, which
drop their checkpoints' ``mtp.*`` tensors), under the checkpoints' names: ``mtp.pre_fc_norm_embedding`` and
``mtp.pre_fc_norm_hidden`` (the fusion's norms), ``mtp.fc`` (its projection of ``cat(embedding, hidden)``),
``mtp.layers.{k}`` (depth ``k``'s one decoder layer, full attention, of the model's own layer class: dense or MoE)
and ``mtp.norm``. The fusion and the final norm are shared by the depths (as vLLM runs them: the config's
``mtp_num_hidden_layers`` counts the layers, one per token ahead). The layers take the rotary positions the
language model got (multi-axis for image rows), moved left with the tokens."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from automodel.mtp.heads import MTPHeads, MTPSettings, shift_left, stack_expert_tensors

# a checkpoint's experts one tensor each (Qwen's files) -> the fused parameters transformers' MoE layer holds
_EXPERT = re.compile(r"^(mtp\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3_5MTPHeads(MTPHeads):
    """The depth loop with the fusion before each depth's layer and the shared final norm after it."""

    def __init__(self, settings: MTPSettings, layers: list[nn.Module], config: Any, norm: type[nn.Module]):
        super().__init__(settings, layers)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = norm(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm = norm(hidden, eps=eps)

    def run_depth(self, hidden: torch.Tensor, embedded: torch.Tensor, layers: nn.ModuleList,
                  kwargs: dict[str, Any]) -> torch.Tensor:
        hidden = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in layers:
            hidden = layer(hidden, **kwargs)
        return self.norm(hidden)


def build_heads(model: nn.Module, text_model: nn.Module, settings: MTPSettings) -> MTPHeads:
    """``settings.physical_depths`` full-attention decoder layers of the language model's own class (numbered after
    its layers, as the checkpoints' attention caches would be) and the shared fusion and norm."""
    config = text_model.config
    depth_config = copy.copy(config)  # the heads' layers are full attention; the model's own config is left alone
    depth_config.layer_types = list(config.layer_types) + ["full_attention"] * settings.physical_depths
    layer_class = type(text_model.layers[0])
    first = len(config.layer_types)
    layers = [layer_class(depth_config, first + index) for index in range(settings.physical_depths)]
    return Qwen3_5MTPHeads(settings, layers, config, type(text_model.norm))


def depth_kwargs(text_model: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None) -> Callable[[int], dict[str, Any]]:
    """What a depth's layer is called with: the language model's causal mask, and the rotary embeddings and text
    positions of the language model's input (``position_ids`` as it got them: none, one row per sample, or the
    multi-axis rows of image inputs, a text row first when packed) moved left with the tokens (the place ``t`` of
    depth ``k`` carries the token ``t + k``)."""
    batch, length = hidden.shape[:2]
    if position_ids is None:
        position_ids = torch.arange(length, device=hidden.device).expand(batch, -1)
    if position_ids.dim() == 2:
        position_ids = position_ids.expand(3, -1, -1)
    text = position_ids[0] if position_ids.shape[0] == 4 else None
    rotary = position_ids[1:] if position_ids.shape[0] == 4 else position_ids
    mask = create_causal_mask(config=text_model.config, inputs_embeds=hidden, attention_mask=attention_mask,
                              cache=None, position_ids=text)

    def for_depth(depth: int) -> dict[str, Any]:
        moved = torch.stack([shift_left(axis, depth, 0) for axis in rotary])
        return {"position_embeddings": text_model.rotary_emb(hidden, moved), "attention_mask": mask,
                "position_ids": None if text is None else shift_left(text, depth, 0)}

    return for_depth


def checkpoint_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's ``mtp.*`` tensors under the model's names: one tensor per expert projection (Qwen's MoE files)
    fused into the experts' ``gate_up_proj`` and ``down_proj``, as transformers loads the main model's."""
    out, stacked = stack_expert_tensors(tensors, _EXPERT)
    for owner in sorted({owner for owner, _ in stacked}):
        gate, up, down = (stacked.get((owner, kind)) for kind in ("gate_proj", "up_proj", "down_proj"))
        counts = [None if tensor is None else tensor.shape[0] for tensor in (gate, up, down)]
        if None in counts or len(set(counts)) > 1:
            raise ValueError(f"{owner}: the checkpoint holds gate_proj, up_proj and down_proj of {counts} experts; "
                             "each expert needs all three")
        out[f"{owner}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{owner}.down_proj"] = down
    return out
