"""The MTP heads on pipeline stages (``distributed.pp_size > 1``), upstream's scheme: the first stage, which holds
the token embedding, embeds each depth's tokens ahead (:func:`automodel.mtp.heads.future_embeddings`); those
embeddings travel beside the hidden states through every stage; the last stage, which holds the heads (the cut keeps
the ``mtp`` module there only), runs them on its final hidden states and returns each depth's hidden states and the
rows' positions beside its output, from which the schedule's loss adds the heads' (``MTPLoss.pipeline_loss``). The
heads' layers take the positions every stage got: Nemotron-H's token positions, or a Qwen3.5 model's multi-axis rope
positions, which the VLM recipe computes on the whole rows before the schedule (``automodel_vlm.pipeline``).
Only while training: a stage in eval mode sends and returns what it does without heads."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel.model_kwargs import MTP_FAMILIES
from automodel.mtp.heads import MTPHeads, find_heads, future_embeddings
from automodel.training.parallel.pipeline_stages import PipelineStageModel, model_parts

HEADS = "mtp"  # where attach_heads puts them on the model (and a stage keeps them)


class StageHeads:
    """What the stages of a model with MTP heads carry (a stage's ``carry``): ``depths`` embeddings from the first
    stage to the last, the heads' run there."""

    def __init__(self, depths: int, family: Any, embedding: str, text_model: str):
        self.depths, self.family, self.embedding, self.text_model = depths, family, embedding, text_model

    def embed(self, stage: nn.Module, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """The first stage's: each depth's embedding of the tokens ahead."""
        return future_embeddings(input_ids, stage.get_submodule(self.embedding), self.depths)

    def run(self, stage: nn.Module, hidden: torch.Tensor, embedded: tuple[torch.Tensor, ...],
            attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> list[torch.Tensor]:
        """The last stage's: the heads on its final hidden states, with the mask and positions the stages got
        (what the text model gets in one process: ``position_ids`` ``[axes, rows, length]`` for multi-axis rope);
        the depths' hidden states, then the rows' text positions (:func:`sample_positions`)."""
        if len(embedded) != self.depths:
            raise AutomodelError(f"the last pipeline stage got {len(embedded)} MTP embeddings for {self.depths} depths")
        heads: MTPHeads = stage.get_submodule(HEADS)
        kwargs_for = self.family.depth_kwargs(stage.get_submodule(self.text_model), hidden, attention_mask,
                                              position_ids)
        return [*heads(hidden, list(embedded), kwargs_for), sample_positions(position_ids, hidden)]


def sample_positions(position_ids: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    """The rows' text positions ``[rows, length]``, by which the loss keeps a packed row's targets within each
    sample (restarting at 0 where a sample starts): token positions as given; of multi-axis rope positions the text
    row packed rows hold first (four axes); none, or the three rope axes of unpacked rows (one sample a row, as the
    loss of one process takes them): counted from 0 over the row."""
    if position_ids is not None and position_ids.dim() == 2:
        return position_ids
    if position_ids is not None and position_ids.shape[0] == 4:
        return position_ids[0]
    return torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)


def carry_heads(model: nn.Module, stages: list[PipelineStageModel]) -> None:
    """Give the stages cut from ``model`` what they carry for its MTP heads (none: nothing to do)."""
    heads = find_heads(model)
    if heads is None:
        return
    model_type = model.config.model_type
    if model_type not in MTP_FAMILIES:
        raise AutomodelError(f"model.num_nextn_predict_layers: the model ({model_type}) holds MTP heads of no family "
                             f"known here ({', '.join(MTP_FAMILIES)}); use distributed.pp_size 1")
    module_name, norm_name, _ = MTP_FAMILIES[model_type]
    carry = StageHeads(heads.settings.depths, importlib.import_module(module_name), model_parts(model)["embedding"],
                       norm_name.rpartition(".")[0])
    for stage in stages:
        stage.carry = carry
