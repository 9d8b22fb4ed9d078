"""Context parallelism (``distributed.cp_size > 1``) for vision-language models: the sequence is split *after* the
multimodal merge.

Every rank of a ``cp`` group runs the model's own forward on the whole micro-batch up to its language model: the
vision encoder on all of the batch's images (or on its share of them, their features gathered:
:mod:`automodel_vlm.frame_sharding`; its attention is not causal, so it keeps SDPA's kernel inside the region), the
image features scattered into the token embeddings, the model's positions (Qwen-VL's multi-axis rope index among
them) computed over the whole rows. A forward pre-hook on the language model then keeps this rank's part of the
merged embeddings and of the positions, in the layout the core's region splits the next-token targets in
(``automodel.training.parallel.context_parallel.split_sequence``), and the language model runs on that part with the
region's attention (ring or all-gather, ``distributed.cp_attention``). The split is differentiable: the vision
tower's gradient on a rank is that of the rank's part of the loss, and FSDP2's average over ``dp x cp`` ranks, with
the engine's ``dp * cp / tokens`` scale, makes it the single-process gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from automodel.errors import AutomodelError
from automodel.training.parallel.context_parallel import ContextParallelBatch, split_sequence

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class MultimodalContextParallelBatch(ContextParallelBatch):
    """A micro-batch whose model inputs stay whole (the model's forward reads every image and placeholder); only
    the next-token targets are split in place, the rest by :class:`SequenceSplit` inside the forward."""

    inputs: dict[str, Any] = field(default_factory=dict)

    def split_in_place(self) -> list[torch.Tensor]:
        return [self.targets]

    def model_inputs(self) -> dict[str, Any]:
        return self.inputs


class SequenceSplit:
    """A forward pre-hook on the language model that, while :meth:`active`, hands it this rank's part of the
    merged embeddings and of the positions (each row's ``0 .. length - 1`` where the model passes none), without
    an attention mask (the region's attention builds its own from the whole rows)."""

    def __init__(self, language_model: torch.nn.Module, cp_mesh: DeviceMesh):
        self.cp_mesh = cp_mesh
        self._on = False
        language_model.register_forward_pre_hook(self._split, with_kwargs=True)

    def _split(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
               ) -> tuple[tuple, dict[str, Any]] | None:
        if not self._on:
            return None
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise AutomodelError(f"distributed.cp_size: context parallelism splits the embeddings the model merges "
                                 f"its images into, but '{type(module).__name__}' was called without inputs_embeds; "
                                 "this model cannot run with context parallelism (set cp_size: 1)")
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(embeds.shape[1], device=embeds.device).expand(embeds.shape[:2])
        return args, {**kwargs, "inputs_embeds": split_sequence(embeds, self.cp_mesh),
                      "position_ids": split_sequence(positions, self.cp_mesh, dim=positions.dim() - 1),
                      "attention_mask": None}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the language model runs on this rank's part of the sequence."""
        self._on = True
        try:
            yield
        finally:
            self._on = False


# model types whose processors mark image tokens (token_type_ids) that the model lets attend to each other both ways
BIDIRECTIONAL_IMAGE_MODELS = ("gemma3", "gemma3n", "gemma4", "paligemma")


def attention_issue(config: Any) -> str | None:
    """Why the model's image tokens do not attend causally, which is all context parallelism's attentions compute
    (ring and all-gather; None: they do); sliding-window layers are the core's check."""
    model_type = getattr(config, "model_type", None)
    if model_type not in BIDIRECTIONAL_IMAGE_MODELS:
        return None
    return (f"a {model_type} model lets each image's tokens attend to each other both ways, but context "
            "parallelism's attention (ring or all-gather) is causal over the split sequence, which would train "
            "another attention; set cp_size: 1")
