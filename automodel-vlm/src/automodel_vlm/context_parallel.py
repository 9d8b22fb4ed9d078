"""Context parallelism (``distributed.cp_size > 1``) for vision-language models: the sequence is split *after* the
multimodal merge.

Every rank of a ``cp`` group runs the model's own forward on the whole micro-batch up to its language model: the
vision encoder on all of the batch's images (or on its share of them, their features gathered:
:mod:`automodel_vlm.frame_sharding`; its attention is not causal, so it keeps SDPA's kernel inside the region), the
image features scattered into the token embeddings, the model's positions (Qwen-VL's multi-axis rope index among
them) computed over the whole rows. A forward pre-hook on the language model then keeps this rank's part of the
merged embeddings and of the positions, in the layout the core's region splits the next-token targets in
(``automodel.training.parallel.context_parallel.split_sequence``), and the language model runs on that part with the
region's attention (ring or all-gather, ``distributed.cp_attention``). Where the model lets spans of tokens attend
to each other both ways (Gemma 3's images, :func:`two_way_spans`), the all-gather attention's mask takes them from
the whole rows' token types; ring attention is refused for such models (:func:`attention_issue`). The split is
differentiable: the vision tower's gradient on a rank is that of the rank's part of the loss, and FSDP2's average
over ``dp x cp`` ranks, with the engine's ``dp * cp / tokens`` scale, makes it the single-process gradient.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from automodel.errors import AutomodelError
from automodel.training.modules import unwrap
from automodel.training.parallel.all_gather_attention import TwoWaySpans
from automodel.training.parallel.blocks import attention_modules
from automodel.training.parallel.context_parallel import ContextParallelBatch, split_sequence
from automodel.training.parallel.pipeline_stages import stage_models
from automodel_vlm.deepstack import split_maps
from automodel_vlm.parts import find_part

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
    merged embeddings, of the positions (each row's ``0 .. length - 1`` where the model passes none), of
    Gemma 4's per-layer inputs and of Qwen3-VL's DeepStack features, without an attention mask (the region's
    attention builds its own from the whole rows)."""

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
        split = {"inputs_embeds": split_sequence(embeds, self.cp_mesh),
                 "position_ids": split_sequence(positions, self.cp_mesh, dim=positions.dim() - 1),
                 "attention_mask": None}
        if kwargs.get("per_layer_inputs") is not None:  # Gemma 4's: [batch, sequence, layers, size]
            split["per_layer_inputs"] = split_sequence(kwargs["per_layer_inputs"], self.cp_mesh)
        split.update(split_maps(kwargs, self.cp_mesh))  # Qwen3-VL's DeepStack features at the image positions
        return args, {**kwargs, **split}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the language model runs on this rank's part of the sequence."""
        self._on = True
        try:
            yield
        finally:
            self._on = False


def two_way_spans(config: Any, inputs: dict[str, Any]) -> TwoWaySpans | None:
    """The spans of a micro-batch's tokens that the model lets attend to each other both ways, by the model's own
    rule (transformers' ``block_sequence_ids``, from the processor's token types): Gemma 3's images on every layer,
    Gemma 4's images and videos on its sliding-window layers (``use_bidirectional_attention: vision``), PaliGemma's
    prefix (image and prompt, ``token_type_ids`` 0) on every layer; None for the others (causal)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3" and inputs.get("token_type_ids") is not None:
        from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

        return TwoWaySpans(get_block_sequence_ids_for_mask(inputs["token_type_ids"]))
    if model_type == "paligemma" and inputs.get("token_type_ids") is not None:
        return TwoWaySpans(torch.where(inputs["token_type_ids"] == 0, 0, -1))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if (model_type == "gemma4" and getattr(text, "use_bidirectional_attention", None) == "vision"
            and inputs.get("mm_token_type_ids") is not None):
        from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask

        ids = inputs["mm_token_type_ids"]
        return TwoWaySpans(get_block_sequence_ids_for_mask(ids, ids.device), full_layers=False)
    return None


# model types whose language model lets spans of tokens (images, a prompt prefix) attend to each other both ways
TWO_WAY_MODELS = ("gemma3", "gemma4", "paligemma")


def two_way_stages(model: torch.nn.Module) -> None:
    """Give the pipeline stages ``model`` holds the rule for the spans their context-parallel attention lets attend
    both ways, from a micro-batch's token types (:func:`two_way_spans`; the core's ``PipelineStageModel.spans_of``),
    for the models that have such spans (and PaliGemma's layers :func:`causal_prefix_attention`)."""
    for stage in stage_models(unwrap(model)):
        if getattr(stage.config, "model_type", None) in TWO_WAY_MODELS:
            stage.spans_of = functools.partial(two_way_spans, stage.config)
        causal_prefix_attention(stage)


def causal_prefix_attention(model: torch.nn.Module) -> int:
    """A PaliGemma's language model attention modules marked causal (how many). transformers sets its text config's
    ``use_bidirectional_attention`` (older checkpoints' behaviour), so its layers ask SDPA for no causal mask and
    its forward hands them the mask it builds (causal, the prefix both ways); under context parallelism they run
    without it, and only causal SDPA calls run the all-gather attention, whose mask takes the prefix span
    (:func:`two_way_spans`). With a mask (outside the region) transformers' SDPA ignores the mark."""
    model = unwrap(model)
    if getattr(getattr(model, "config", None), "model_type", None) != "paligemma":
        return 0
    found = find_part(model, "language_model")
    modules = attention_modules(found[1]) if found is not None else []
    for module in modules:
        module.is_causal = True
    return len(modules)


def attention_issue(config: Any, attention: str) -> str | None:
    """Why context parallelism's ``attention`` (ring or all_gather) does not compute the model's attention (None:
    it does); sliding-window layers are the core's check. The all-gather attention's mask takes the spans that
    attend both ways (:func:`two_way_spans`); torch's ring attention is causal only. PaliGemma's text config says
    ``use_bidirectional_attention`` but its forward's mask is causal with the prefix both ways
    (:func:`causal_prefix_attention`)."""
    model_type = getattr(config, "model_type", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "use_bidirectional_attention", None) in (True, "all") and model_type != "paligemma":
        return (f"a {model_type} model whose language model attends both ways over the whole sequence "
                "(use_bidirectional_attention), which context parallelism's causal attention does not compute; set "
                "cp_size: 1")
    if model_type == "gemma3n":
        return ("a gemma3n model (per-layer inputs, audio and key/value sharing across layers) has not been checked "
                "against one process under context parallelism; set cp_size: 1")
    if model_type in TWO_WAY_MODELS and attention == "ring":
        return (f"a {model_type} model lets spans of its tokens (its images) attend to each other both ways, but "
                "torch's ring attention (distributed.cp_attention: ring) is causal over the split sequence, which "
                "would train another attention; set distributed.cp_attention: all_gather (or auto), whose mask "
                "takes those spans")
    return None
