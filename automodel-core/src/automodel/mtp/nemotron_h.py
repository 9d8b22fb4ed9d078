"""Nemotron-H's MTP sublayers (transformers' ``NemotronHForCausalLM``, whose checkpoints' ``mtp.*`` tensors it
drops): each is a Nemotron-H block (``norm``, ``mixer``, residual) of the type ``config.mtp_layers_block_type``
names for its place in a depth, the first of a depth also holding ``enorm``, ``hnorm`` and ``eh_proj``, the last
``final_layernorm``: the names NVIDIA's checkpoints use (``mtp.layers.{i}.eh_proj.weight``,
``mtp.layers.{i}.mixer.q_proj.weight`` ...)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock, NemotronHRMSNorm

from automodel.mtp.heads import MTPHeads, MTPSettings, shift_left, stack_expert_tensors

# a checkpoint's experts one tensor each (NVIDIA's files) -> the stacked parameter transformers' model holds
_EXPERT = re.compile(r"^(mtp\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


class NemotronHMTPLayer(NemotronHBlock):
    """A Nemotron-H block with the fusion of a depth's first sublayer and the final norm of its last one."""

    def __init__(self, config: Any, layer_idx: int, fusion: bool, final_norm: bool):
        super().__init__(config, layer_idx)
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        if fusion:
            self.enorm = NemotronHRMSNorm(hidden, eps=eps)
            self.hnorm = NemotronHRMSNorm(hidden, eps=eps)
            self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        if final_norm:
            self.final_layernorm = NemotronHRMSNorm(hidden, eps=eps)

    def forward(self, hidden_states: torch.Tensor, embedded: torch.Tensor | None = None,
                masks: dict[str, Any] | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if hasattr(self, "eh_proj"):
            hidden_states = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden_states)], dim=-1))
        hidden_states = super().forward(hidden_states, attention_mask=(masks or {}).get(self.block_type),
                                        position_ids=position_ids)
        return self.final_layernorm(hidden_states) if hasattr(self, "final_layernorm") else hidden_states


def build_heads(model: nn.Module, text_model: nn.Module, settings: MTPSettings) -> MTPHeads:
    """The sublayers of ``settings.physical_depths`` depths, each of ``config.mtp_layers_block_type``."""
    config = text_model.config
    kinds = list(config.mtp_layers_block_type or [])
    if not kinds:
        raise ValueError("the nemotron_h config has no mtp_layers_block_type (the block types of an MTP depth)")
    depth_config = copy.copy(config)  # its blocks are of the MTP types; the model's own config is left alone
    depth_config.layers_block_type = kinds
    return MTPHeads(settings, [NemotronHMTPLayer(depth_config, index, fusion=index == 0,
                                                 final_norm=index == len(kinds) - 1)
                               for _ in range(settings.physical_depths) for index in range(len(kinds))])


def depth_kwargs(text_model: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None) -> Callable[[int], dict[str, Any]]:
    """What a depth's blocks are called with: the masks of their types (built as the model builds its own) and the
    positions moved left with the tokens (the place ``t`` of depth ``k`` carries the token ``t + k``)."""
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
    config = text_model.config
    masks = {"full_attention": create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask,
                                                  cache=None, position_ids=position_ids),
             "linear_attention": create_recurrent_attention_mask(config=config, inputs_embeds=hidden,
                                                                 attention_mask=attention_mask, cache=None)}
    return lambda depth: {"masks": masks, "position_ids": shift_left(position_ids, depth, 0)}


def checkpoint_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's ``mtp.*`` tensors under the model's names: one tensor per expert (NVIDIA's files) stacked
    into the experts' parameter, as transformers loads the main model's; stacked ones as they are."""
    others, stacked = stack_expert_tensors(tensors, _EXPERT)
    return {**others, **{f"{owner}.{projection}": tensor for (owner, projection), tensor in stacked.items()}}
