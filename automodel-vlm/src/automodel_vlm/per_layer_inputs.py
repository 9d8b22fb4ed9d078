"""Gemma 4's per-layer inputs through pipeline stages.

A Gemma 4 text model with ``hidden_size_per_layer_input`` (the E2B / E4B sizes) gives every decoder layer ``i``
its own input beside the hidden states: slice ``i`` of a ``[rows, positions, layers, size]`` tensor made once,
before the layers, from the token ids (``embed_tokens_per_layer``, the image positions' ids replaced by the pad id)
and from the merged embeddings (``per_layer_model_projection`` and its norm). Only the first pipeline stage has the
token ids and the embeddings, so it alone holds those modules (the core's ``pipeline_plans.FIRST_STAGE_ONLY``) and
makes the tensor as the model's forward does; the slices of the layers after it travel beside the hidden states
(the stage's ``beside``, see ``pipeline_stages``), one ``[rows, positions, size]`` tensor a layer. A later stage
hands its text model the slices as the per-layer inputs (zeros for the layers before it, which its placeholders
skip) in place of making them, and sends on those of the layers after it. Under context parallelism the first
stage makes them on this rank's part of the merged embeddings (the token-identity part split like them), so every
slice is this rank's part of the positions, as the hidden states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel.training.modules import unwrap
from automodel.training.parallel.context_parallel import split_sequence
from automodel.training.parallel.pipeline_stages import stage_layer_ranges, stage_models

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def per_layer_size(config: Any) -> int:
    """The size of each layer's input of a Gemma 4 model with per-layer inputs (0: none)."""
    if getattr(config, "model_type", None) != "gemma4":
        return 0
    return int(getattr(config.get_text_config(), "hidden_size_per_layer_input", 0) or 0)


class PerLayerInputsTravel:
    """A stage's ``beside`` for a model of ``layers`` decoder layers, each taking a per-layer input of ``width``."""

    def __init__(self, layers: int, width: int):
        self.layers, self.width = layers, width

    def counts(self, stage: Any) -> tuple[int, int]:
        """The slices ``stage`` takes (its layers' and the later layers') and sends (the later layers')."""
        taken = 0 if stage.is_first else self.layers - stage.layer_range.start
        sent = 0 if stage.is_last else self.layers - stage.layer_range.stop
        return taken, sent

    @contextlib.contextmanager
    def running(self, stage: Any, taken: tuple[torch.Tensor, ...], sent: list[torch.Tensor],
                cp_mesh: DeviceMesh | None = None) -> Iterator[None]:
        """Within the block ``stage``'s text model runs its layers on their per-layer inputs; ``sent`` then holds
        those of the later layers."""
        expected, _ = self.counts(stage)
        if len(taken) != expected:
            raise AutomodelError(f"pipeline stage {stage.index} got {len(taken)} per-layer inputs beside the hidden "
                                 f"states, but its layers {stage.layer_range.start}.. take {expected}")
        text = stage.get_submodule(stage._text)
        start, stop = stage.layer_range.start, stage.layer_range.stop
        handle = None
        if stage.is_first:
            text.project_per_layer_inputs = self._making(stage, text, sent, cp_mesh)
        else:
            handle = text.register_forward_pre_hook(self._handing(start, taken[:stop - start]), with_kwargs=True)
            text.project_per_layer_inputs = _as_made
            sent.extend(tensor.view_as(tensor) for tensor in taken[stop - start:])
        try:
            yield
        finally:
            del text.project_per_layer_inputs  # the class's method again
            if handle is not None:
                handle.remove()

    def _making(self, stage: Any, text: nn.Module, sent: list[torch.Tensor], cp_mesh: DeviceMesh | None) -> Any:
        """The first stage's ``project_per_layer_inputs``: the model's own, whose slices of the later layers it
        puts in ``sent``."""
        stop = stage.layer_range.stop

        def project(embeds: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
            if cp_mesh is not None and given is not None and given.shape[1] != embeds.shape[1]:
                given = split_sequence(given, cp_mesh)  # the token-identity part of the whole rows
            made = type(text).project_per_layer_inputs(text, embeds, given)
            for number in range(stop, self.layers):
                part = made[:, :, number].contiguous()
                if torch.is_grad_enabled() and stage.training and not part.requires_grad:
                    part.requires_grad_()  # every micro-batch's slices as torch's stage first saw them
                sent.append(part)
            return made

        return project

    def _handing(self, start: int, own: tuple[torch.Tensor, ...]) -> Any:
        """A pre-hook on a later stage's text model handing it the per-layer inputs of its layers (from ``start``),
        zeros for the layers before them."""
        def hand(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            stacked = torch.stack([_ContiguousGrad.apply(tensor) for tensor in own], dim=2)
            before = stacked.new_zeros((*stacked.shape[:2], start, stacked.shape[-1]))
            return args, {**kwargs, "per_layer_inputs": torch.cat([before, stacked], dim=2)}

        return hand


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: a stacked slice's gradient is a strided view, and torch's
    pipeline stage receives each input's gradient into a buffer of that layout, which the process group's receive
    refuses."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _as_made(embeds: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
    """A later stage's ``project_per_layer_inputs``: the per-layer inputs it was handed are the made ones."""
    return given


def travel_per_layer_inputs(model: nn.Module) -> str | None:
    """Give the pipeline stages ``model`` holds (one, or a rank's several; wrapped or not) what they carry for a
    Gemma 4 model with per-layer inputs; the line that says what travels (None: the model has none)."""
    stages = stage_models(unwrap(model))
    config = stages[0].config
    width = per_layer_size(config)
    if not width:
        return None
    layers = config.get_text_config().num_hidden_layers
    travel = PerLayerInputsTravel(layers, width)
    for stage in stages:
        if getattr(stage, "carry", None) is not None or getattr(stage, "beside", None) is not None:
            raise AutomodelError("distributed.pp_size: a model whose per-layer inputs travel between pipeline "
                                 "stages cannot also carry other tensors between them (MTP heads' embeddings); "
                                 "remove the MTP keys or set pp_size: 1")
        stage.beside = travel
    first = stage_layer_ranges(layers, stages[0].num_stages)[0]
    return (f"pipeline: the per-layer inputs of layers {first.stop}-{layers - 1} ({width} values a position each) "
            "travel beside the hidden states from the first stage, which makes them, to the stages holding those "
            "layers")
