"""Context parallelism through recurrent layers: a Mamba or linear-attention (gated delta rule) mixer, or a short
convolution, carries a state along the whole sequence, which no rank's part of it (chunks ``r`` and ``2n - 1 - r``
of ``2n``) holds alone. Inside the all-gather region each such mixer runs on the whole rows instead: its input is
gathered over the ``cp`` group (:class:`~automodel.training.parallel.all_gather_attention.WholeSequence`), every
rank runs the mixer on it with the whole rows' padding mask, and keeps its own part of the output. Backward sums
every rank's gradient of the gathered input and keeps this rank's part, so each rank's gradients are those of its
own tokens' losses, as the attention layers' are (FSDP2 sums them over ``dp x cp``). The mixers' compute and
activations are those of the whole rows on every rank (the attention, MLP and MoE layers stay split).

A mixer is found in each decoder layer whose type is recurrent (``layer_types`` of the text config, or the layer's
own ``block_type`` / ``layer_type``) as its child of one of :data:`MIXER_NAMES`: Qwen3.5's / Qwen3-Next's
``linear_attn``, Nemotron-H's ``mixer``, Falcon-H1's ``mamba`` (beside its split attention, ``hybrid``), LFM2's
``conv``, Kimi Linear's ``self_attn`` (its delta attention in a ``linear_attention`` layer). Outside the region
(validation, generation: whole rows on every rank) the mixers run as they are.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from torch import nn

from automodel.errors import AutomodelError
from automodel.training.parallel.all_gather_attention import SplitRegion
from automodel.training.parallel.blocks import transformer_blocks

# transformers' layer_types of layers whose state runs along the sequence: Mamba / gated-delta-rule layers
# ('linear_attention'), Falcon-H1's attention-beside-Mamba ('hybrid'), LFM2's short convolutions ('conv')
RECURRENT_LAYERS = ("linear_attention", "hybrid", "conv")
# a recurrent layer's mixer, as transformers names it (Kimi Linear's delta attention in its linear layers: self_attn)
MIXER_NAMES = ("linear_attn", "mixer", "mamba", "conv", "self_attn")
_INDEX = re.compile(r"(?:^|\.)(\d+)$")


def recurrent_layer_count(config: Any) -> int:
    """How many of the text model's layers are recurrent (``layer_types``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return sum(kind in RECURRENT_LAYERS for kind in getattr(text, "layer_types", None) or ())


def recurrent_mixers(model: nn.Module, config: Any, skip: Collection[nn.Module] = ()) -> list[nn.Module]:
    """The mixer of each recurrent decoder layer of ``model`` (a pipeline stage: of those it holds), below wrappers
    (activation checkpointing) too; an error where a recurrent layer has none of :data:`MIXER_NAMES`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = list(getattr(text, "layer_types", None) or ())
    blocks = {id(block) for block in transformer_blocks(model, skip)}
    mixers = []
    for name, block in model.named_modules():
        if id(block) not in blocks:
            continue
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        found = _INDEX.search(name)
        kind = getattr(inner, "block_type", None) or getattr(inner, "layer_type", None) or \
            (layer_types[int(found[1])] if found and int(found[1]) < len(layer_types) else None)
        if kind not in RECURRENT_LAYERS:
            continue
        mixer = next((getattr(inner, child) for child in MIXER_NAMES
                      if isinstance(getattr(inner, child, None), nn.Module)), None)
        if mixer is None:
            raise AutomodelError(f"context parallelism: the {kind} layer '{name}' ({type(inner).__name__}) has no "
                                 f"recurrent mixer this build knows ({', '.join(MIXER_NAMES)}); set "
                                 "distributed.cp_size: 1")
        mixers.append(mixer)
    return mixers


def run_on_whole_rows(mixers: list[nn.Module]) -> int:
    """Make each of ``mixers`` run on the whole rows inside the all-gather region (see the module docstring);
    returns how many."""

    def gather(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        sequence = SplitRegion.sequence if SplitRegion.active else None
        if sequence is None:
            return None
        if args:
            args = (sequence.gather(args[0]), *args[1:])
        else:
            kwargs = {**kwargs, "hidden_states": sequence.gather(kwargs["hidden_states"])}
        return args, {**kwargs, "attention_mask": sequence.attention_mask}

    def keep_part(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        sequence = SplitRegion.sequence if SplitRegion.active else None
        if sequence is None:
            return None
        return (sequence.part(output[0]), *output[1:]) if isinstance(output, tuple) else sequence.part(output)

    for mixer in mixers:
        mixer.register_forward_pre_hook(gather, with_kwargs=True)
        mixer.register_forward_hook(keep_part, with_kwargs=True)
    return len(mixers)
