"""Qwen3-VL's DeepStack features through pipeline stages.

Qwen3-VL's vision tower returns, besides the merged image features, one feature map per entry of the vision
config's ``deepstack_visual_indexes`` (DeepStack); its language model adds map ``j`` to the hidden states at the
image (and video) positions right after decoder layer ``j``. The tower runs on the first pipeline stage, but the
layers that take the maps may lie on later stages (a first stage of fewer layers than maps), so the maps travel
beside the hidden states (the stage's ``beside``, see ``pipeline_stages``): the first stage scatters every map into a
``[rows, positions, hidden]`` tensor (zero away from the images, so the schedule splits it with the rows and adding
it changes nothing else; under context parallelism this rank's part of the positions, as the merged embeddings),
hands the model's own forward those of its layers (every position marked) and sends the others; a later stage adds
those of its layers after them (a forward hook) and sends on the rest. A stage without such layers after it sends
none, so with the usual cut (the maps' few layers on the first stage) nothing travels.
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

DEEPSTACK_MODELS = ("qwen3_vl", "qwen3_vl_moe")  # model types whose language model adds DeepStack features


def deepstack_layers(config: Any) -> int:
    """How many of the first decoder layers take a DeepStack feature map (0: the model has none)."""
    if getattr(config, "model_type", None) not in DEEPSTACK_MODELS:
        return 0
    return len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())


def scattered_maps(embeds: torch.Tensor, maps: list[torch.Tensor], where: torch.Tensor) -> list[torch.Tensor]:
    """Each DeepStack map (``[visual positions, hidden]``, the order of ``where``'s marked positions) scattered into a
    tensor like ``embeds`` (``[rows, positions, hidden]``), zero elsewhere: what the language model adds after each
    layer at every position, so it can be split along the rows or the positions."""
    mask = where.unsqueeze(-1).to(embeds.device)
    return [torch.zeros_like(embeds).masked_scatter(mask, part.to(embeds.device, embeds.dtype)) for part in maps]


def split_maps(kwargs: dict[str, Any], cp_mesh: DeviceMesh) -> dict[str, Any]:
    """A Qwen3-VL language model's DeepStack keyword arguments (of the whole rows) for this rank's part of the
    sequences (context parallelism, ``context_parallel.SequenceSplit``): the maps scattered over the rows and split
    like the embeddings, every position of the part marked; empty where there are none."""
    maps = kwargs.get("deepstack_visual_embeds")
    if maps is None:
        return {}
    parts = [split_sequence(scattered, cp_mesh)
             for scattered in scattered_maps(kwargs["inputs_embeds"], maps, kwargs["visual_pos_masks"])]
    everywhere = torch.ones(parts[0].shape[:2], dtype=torch.bool, device=parts[0].device)
    return {"visual_pos_masks": everywhere, "deepstack_visual_embeds": [part.flatten(0, 1) for part in parts]}


class DeepStackTravel:
    """A stage's ``beside`` for a model whose first ``layers`` decoder layers take a DeepStack map each."""

    def __init__(self, layers: int):
        self.layers = layers

    def counts(self, stage: Any) -> tuple[int, int]:
        """The maps ``stage`` takes (those of its layers and of the layers after it) and sends (of the layers after
        it)."""
        taken = 0 if stage.is_first else max(0, self.layers - stage.layer_range.start)
        sent = 0 if stage.is_last else max(0, self.layers - stage.layer_range.stop)
        return taken, sent

    @contextlib.contextmanager
    def running(self, stage: Any, taken: tuple[torch.Tensor, ...], sent: list[torch.Tensor],
                cp_mesh: DeviceMesh | None = None) -> Iterator[None]:
        """Within the block ``stage``'s model forward adds the maps of its layers; ``sent`` then holds the rest.
        With ``cp_mesh`` (context parallelism) the stages run on this rank's part of the sequences: the first stage
        splits the maps it scattered over the whole rows as the merged embeddings are split."""
        expected, _ = self.counts(stage)
        if len(taken) != expected:
            raise AutomodelError(f"pipeline stage {stage.index} got {len(taken)} DeepStack feature maps beside the "
                                 f"hidden states, but its layers {stage.layer_range.start}.. take {expected}")
        text = stage.get_submodule(stage._text)
        if stage.is_first:
            handles = [text.register_forward_pre_hook(self._first_stage(stage, sent, cp_mesh), with_kwargs=True)]
        else:
            start, stop = stage.layer_range.start, stage.layer_range.stop
            layers = text.get_submodule("layers")
            handles = [layers[number].register_forward_hook(_adding(taken[number - start]))
                       for number in range(start, min(stop, self.layers))]
            sent.extend(tensor.view_as(tensor) for tensor in taken[max(0, stop - start):])
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _first_stage(self, stage: Any, sent: list[torch.Tensor], cp_mesh: DeviceMesh | None) -> Any:
        """The pre-hook on the first stage's language model (it runs before the context-parallel split of the
        embeddings): every map scattered over the positions of the rows (this rank's part of them under context
        parallelism); those of the stage's layers handed to the model's own forward with every position marked, the
        others put in ``sent``."""
        own = min(self.layers, stage.layer_range.stop)

        def split(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            embeds, maps = kwargs["inputs_embeds"], kwargs.get("deepstack_visual_embeds")
            if maps is None:  # no images in these rows: nothing to add
                dense = [torch.zeros_like(embeds) for _ in range(self.layers)]
            else:
                dense = scattered_maps(embeds, maps, kwargs["visual_pos_masks"])
            if cp_mesh is not None:
                dense = [split_sequence(scattered, cp_mesh) for scattered in dense]
            for scattered in dense[own:]:
                if torch.is_grad_enabled() and stage.training and not scattered.requires_grad:
                    scattered.requires_grad_()  # every micro-batch's maps as torch's stage first saw them
                sent.append(scattered)
            if maps is not None:
                everywhere = torch.ones(dense[0].shape[:2], dtype=torch.bool, device=embeds.device)
                kwargs = {**kwargs, "visual_pos_masks": everywhere,
                          "deepstack_visual_embeds": [part.flatten(0, 1) for part in dense[:own]]}
            return args, kwargs

        return split


def _adding(dense: torch.Tensor) -> Any:
    """A forward hook adding ``dense`` to a decoder layer's output hidden states."""
    def add(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] + dense.to(output[0].dtype), *output[1:])
        return output + dense.to(output.dtype)

    return add


def travel_deepstack(model: nn.Module) -> str | None:
    """Give the pipeline stages ``model`` holds (one, or a rank's several; wrapped or not) what they carry for a
    DeepStack model; the line that says what travels (None: not a DeepStack model). MTP heads' embeddings travel
    the same way, which this does not combine with."""
    stages = stage_models(unwrap(model))
    config = stages[0].config
    layers = deepstack_layers(config)
    if not layers:
        return None
    travel = DeepStackTravel(layers)
    for stage in stages:
        if getattr(stage, "carry", None) is not None:
            raise AutomodelError("distributed.pp_size: a model whose DeepStack features travel between pipeline "
                                 "stages cannot also carry MTP heads' embeddings; remove the MTP keys or set "
                                 "pp_size: 1")
        stage.beside = travel
    first = stage_layer_ranges(config.get_text_config().num_hidden_layers, stages[0].num_stages)[0]
    if first.stop >= layers:
        return f"pipeline: the DeepStack features of layers 0-{layers - 1} stay on the first stage, which holds them"
    return (f"pipeline: the DeepStack features of layers {first.stop}-{layers - 1} travel beside the hidden states "
            "from the first stage to the stages holding those layers")
