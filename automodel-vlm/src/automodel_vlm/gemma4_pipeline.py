"""Gemma 4's per-layer inputs and shared keys and values through pipeline stages (its E2B / E4B sizes).

Per-layer inputs (``text_config.hidden_size_per_layer_input``): every decoder layer ``i`` takes its own input beside
the hidden states, slice ``i`` of a ``[rows, positions, layers, size]`` tensor made once, before the layers, from
the token ids (``embed_tokens_per_layer``, the image positions' ids replaced by the pad id) and from the merged
embeddings (``per_layer_model_projection`` and its norm). Only the first pipeline stage has the token ids and the
embeddings, so it alone holds those modules (the core's ``pipeline_plans.FIRST_STAGE_ONLY``) and makes the tensor
as the model's forward does; the slices of the later stages' layers travel beside the hidden states (the stage's
``beside``, see ``pipeline_stages``), one ``[rows, positions, size]`` tensor a layer. A later stage hands its text
model the slices as the per-layer inputs (zeros for the layers before it, which its placeholders skip) in place of
making them.

Shared keys and values (``text_config.num_kv_shared_layers``): the last layers compute no keys and values of their
own but reuse those of the last earlier layer of their type (sliding or full attention; ``kv_sharing_modes``
"store" and "reuse"). Where a storing layer and a reusing one lie on different stages, the stage that runs the
storing layer sends its keys and values (``[rows, positions, heads x head size]`` each) on to the stages up to the
last reusing one, each handing them to its text model as the model's own ``shared_kv_states``.

Each stage sends on what the stages after it take. Under context parallelism the stages run on this rank's part of
the positions, and so does everything that travels.
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
from automodel.training.parallel.pipeline_stages import stage_models

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def per_layer_size(config: Any) -> int:
    """The size of each layer's input of a Gemma 4 model with per-layer inputs (0: none)."""
    if getattr(config, "model_type", None) != "gemma4":
        return 0
    return int(getattr(config.get_text_config(), "hidden_size_per_layer_input", 0) or 0)


def kv_sharing(config: Any) -> dict[str, tuple[int, list[int], int, int]]:
    """Layer type -> (its storing layer, the layers reusing its keys and values, their heads, head size) for a
    Gemma 4 whose last layers share keys and values (empty: none)."""
    if getattr(config, "model_type", None) != "gemma4":
        return {}
    text = config.get_text_config()
    if not getattr(text, "num_kv_shared_layers", 0):
        return {}
    modes, types = text.kv_sharing_modes, text.layer_types
    found = {}
    for kind in sorted(set(types)):
        stores = [i for i, mode in enumerate(modes) if mode == "store" and types[i] == kind]
        reuses = [i for i, mode in enumerate(modes) if mode == "reuse" and types[i] == kind]
        if reuses and stores:
            layer = text.per_layer_config[stores[0]]
            found[kind] = (stores[0], reuses, layer.num_key_value_heads, layer.head_dim)
    return found


class Gemma4Travel:
    """A stage's ``beside`` for a Gemma 4 of ``layers`` decoder layers: the per-layer inputs (``width`` each, 0:
    none) of the layers after the stage, then the keys and values of each shared layer type (``shared``, see
    :func:`kv_sharing`) computed at or before the stage and reused after it."""

    def __init__(self, layers: int, width: int, shared: dict[str, tuple[int, list[int], int, int]]):
        self.layers, self.width, self.shared = layers, width, shared

    def _kinds(self, start: int, stop: int) -> list[str]:
        """The shared layer types whose keys and values are stored before ``start`` and reused from ``stop`` on."""
        return [kind for kind, (store, reuses, *_) in self.shared.items() if store < start and max(reuses) >= stop]

    def _plan(self, stage: Any) -> tuple[list[int], list[str], list[int], list[str]]:
        """(layers whose inputs ``stage`` takes, shared types it takes, layers whose inputs it sends, types it
        sends)."""
        start, stop = stage.layer_range.start, stage.layer_range.stop
        per_layer = bool(self.width)
        taken = list(range(start, self.layers)) if per_layer and not stage.is_first else []
        sent = list(range(stop, self.layers)) if per_layer and not stage.is_last else []
        kinds_taken = [] if stage.is_first else self._kinds(start, start)
        kinds_sent = [] if stage.is_last else self._kinds(stop, stop)
        return taken, kinds_taken, sent, kinds_sent

    def counts(self, stage: Any) -> tuple[int, int]:
        """How many tensors ``stage`` takes and sends."""
        taken, kinds_taken, sent, kinds_sent = self._plan(stage)
        return len(taken) + 2 * len(kinds_taken), len(sent) + 2 * len(kinds_sent)

    def widths(self, stage: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The last dimension of each tensor ``stage`` takes and sends (static stage shapes)."""
        taken, kinds_taken, sent, kinds_sent = self._plan(stage)

        def of(layers: list[int], kinds: list[str]) -> tuple[int, ...]:
            pairs = [self.shared[kind][2] * self.shared[kind][3] for kind in kinds for _ in range(2)]
            return (*(self.width for _ in layers), *pairs)

        return of(taken, kinds_taken), of(sent, kinds_sent)

    @contextlib.contextmanager
    def running(self, stage: Any, taken: tuple[torch.Tensor, ...], sent: list[torch.Tensor],
                cp_mesh: DeviceMesh | None = None) -> Iterator[None]:
        """Within the block ``stage``'s text model runs its layers on their per-layer inputs and the shared keys
        and values it was sent; after it ``sent`` holds what the later stages take."""
        expected, _ = self.counts(stage)
        if len(taken) != expected:
            raise AutomodelError(f"pipeline stage {stage.index} got {len(taken)} tensors beside the hidden states, "
                                 f"but its layers {stage.layer_range.start}.. take {expected} (Gemma 4's per-layer "
                                 "inputs and shared keys and values)")
        layers_taken, kinds_taken, layers_sent, kinds_sent = self._plan(stage)
        start, stop = stage.layer_range.start, stage.layer_range.stop
        text = stage.get_submodule(stage._text)
        inputs, pairs = taken[:len(layers_taken)], taken[len(layers_taken):]
        heads = {kind: self.shared[kind][3] for kind in kinds_taken}  # their head size
        states = _kv_dict({kind: (_unflat(pairs[2 * n], heads[kind]), _unflat(pairs[2 * n + 1], heads[kind]))
                           for n, kind in enumerate(kinds_taken)}) if self.shared else None
        made: list[torch.Tensor] = []
        if self.width and stage.is_first:
            text.project_per_layer_inputs = self._making(stage, text, made, cp_mesh)
        elif self.width:
            text.project_per_layer_inputs = _as_made
        own = inputs[:stop - start]
        handle = text.register_forward_pre_hook(_handing(start, own, states), with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()
            if self.width:
                del text.project_per_layer_inputs  # the class's method again
        sent.extend(made if stage.is_first else [tensor.view_as(tensor) for tensor in inputs[stop - start:]])
        for kind in kinds_sent:
            for tensor in states[kind]:
                flat = tensor.transpose(1, 2).flatten(2)  # [rows, positions, heads x head size]
                if torch.is_grad_enabled() and stage.training and not flat.requires_grad:
                    flat.requires_grad_()
                sent.append(flat)

    def _making(self, stage: Any, text: nn.Module, made: list[torch.Tensor], cp_mesh: DeviceMesh | None) -> Any:
        """The first stage's ``project_per_layer_inputs``: the model's own, whose slices of the later stages'
        layers it puts in ``made``."""
        stop = stage.layer_range.stop

        def project(embeds: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
            if cp_mesh is not None and given is not None and given.shape[1] != embeds.shape[1]:
                given = split_sequence(given, cp_mesh)  # the token-identity part of the whole rows
            result = type(text).project_per_layer_inputs(text, embeds, given)
            for number in range(stop, self.layers):
                part = result[:, :, number].contiguous()
                if torch.is_grad_enabled() and stage.training and not part.requires_grad:
                    part.requires_grad_()  # every micro-batch's slices as torch's stage first saw them
                made.append(part)
            return result

        return project


def _kv_dict(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """transformers' container of the shared keys and values (the text model fills the one it is handed)."""
    from transformers.cache_utils import KVSharingDict

    return KVSharingDict(pairs)


def _unflat(flat: torch.Tensor, head_size: int) -> torch.Tensor:
    """``[rows, positions, heads x head size]`` as the attention's ``[rows, heads, positions, head size]``."""
    return _ContiguousGrad.apply(flat).unflatten(2, (-1, head_size)).transpose(1, 2)


def _handing(start: int, own: tuple[torch.Tensor, ...], states: Any) -> Any:
    """A pre-hook on a stage's text model handing it the per-layer inputs of its layers (``own``, from layer
    ``start``; zeros for the layers before them) and the shared keys and values (``states``)."""
    def hand(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        extra: dict[str, Any] = {}
        if own:
            stacked = torch.stack([_ContiguousGrad.apply(tensor) for tensor in own], dim=2)
            before = stacked.new_zeros((*stacked.shape[:2], start, stacked.shape[-1]))
            extra["per_layer_inputs"] = torch.cat([before, stacked], dim=2)
        if states is not None:
            extra["shared_kv_states"] = states
        return args, {**kwargs, **extra}

    return hand


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: a stacked (or reshaped) input's gradient is a strided view, and
    torch's pipeline stage receives each input's gradient into a buffer of that layout, which the process group's
    receive refuses."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _as_made(embeds: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
    """A later stage's ``project_per_layer_inputs``: the per-layer inputs it was handed are the made ones."""
    return given


def travel_gemma4(model: nn.Module) -> str | None:
    """Give the pipeline stages ``model`` holds (one, or a rank's several; wrapped or not) what they carry for a
    Gemma 4 with per-layer inputs or shared keys and values; the line that says what travels (None: neither)."""
    stages = stage_models(unwrap(model))
    config = stages[0].config
    width, shared = per_layer_size(config), kv_sharing(config)
    if not width and not shared:
        return None
    travel = Gemma4Travel(config.get_text_config().num_hidden_layers, width, shared)
    for stage in stages:
        if getattr(stage, "carry", None) is not None or getattr(stage, "beside", None) is not None:
            raise AutomodelError("distributed.pp_size: a Gemma 4 whose per-layer inputs or shared keys and values "
                                 "travel between pipeline stages cannot also carry other tensors between them (MTP "
                                 "heads' embeddings); remove the MTP keys or set pp_size: 1")
        stage.beside = travel
    what = [f"per-layer inputs ({width} values a position and layer)"] if width else []
    what += [f"the keys and values its layer {store} stores for the {kind} layers {reuses[0]}-{reuses[-1]}"
             for kind, (store, reuses, *_) in shared.items()]
    return (f"pipeline: Gemma 4's {' and '.join(what)} travel beside the hidden states to the stages whose layers "
            "take them")
