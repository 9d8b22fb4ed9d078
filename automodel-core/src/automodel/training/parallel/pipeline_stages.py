"""A Hugging Face causal LM cut into pipeline stages, each a module holding the original model's names.

The cut follows the model's own pipeline plan (transformers' ``pp_plan``: the input embedding, the decoder layers,
the final norm, the output head). Stage ``s`` of ``n`` holds a contiguous range of layers; the first also holds
the embedding, the last the final norm and the head, every stage the rotary embedding (a buffer) and whatever else
the text model holds. A composite model (a VLM: vision tower + projector + language model + head) is cut the same
way along its language model, whose parts its plan names; the first stage alone holds the media modules. Layers of
other stages become :class:`LayerPlaceholder`\\ s and the model's own forward runs each stage (``inputs_embeds``
carries the hidden states between stages), so masks, positions and rotary embeddings are the model's. A stage's
``state_dict`` names are the whole model's (``model.layers.7.mlp.up_proj.weight``), so sharded checkpoints, the HF
export and :func:`materialize` (seeded per module name) treat a stage like a part of the one model: a stage is
initialised, loaded and saved exactly as the same modules of the model.

Cut the model on the meta device (each stage is a copy of it) and materialise the stages afterwards. A rank that
runs several stages (interleaved schedules) hands the training loop :class:`LocalStages`: its stages' modules
(shared, not copied) in one tree under the model's names, so the optimizer, the gradient clipping and the
checkpoints see one model, as with one stage per rank.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel.model_files import saved_names
from automodel.training.parallel.all_gather_attention import all_gather_region
from automodel.training.parallel.blocks import LayerPlaceholder
from automodel.training.parallel.context_parallel import split_sequence
from automodel.training.parallel.pipeline_media import MASK_PREFIX, model_media
from automodel.training.parallel.pipeline_plans import first_stage_only, pipeline_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """The layers of each stage, as even as possible (the first stages one more)."""
    if num_stages > num_layers:
        raise AutomodelError(f"{num_stages} pipeline stages for {num_layers} layers: each stage needs a layer")
    size, extra = divmod(num_layers, num_stages)
    starts = [s * size + min(s, extra) for s in range(num_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


def stage_indices(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stages rank ``pp_rank`` runs: ``pp_rank``, ``pp_rank + pp_size``, ... (the looped order of torch's
    interleaved schedules)."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


class PipelineStageModel(nn.Module):
    """One stage: the causal LM's own children (pruned to this stage), under the causal LM's names.

    ``forward(inputs, attention_mask=None, position_ids=None, **media)``: token ids on the first stage, the
    previous stage's hidden states on the others; returns the hidden states, or the logits on the last stage (with
    :attr:`head_in_loss`: its final hidden states, which the schedule's loss projects through :attr:`output_head`
    itself). The first stage runs the base model (a composite model's: media encoders, projector, embedding, its
    layers, with the micro-batch's media, see ``pipeline_media``), the others the text model that holds the
    layers. Every stage gets the micro-batch's keyword arguments (torch's schedule hands them to each), so position
    ids that restart at each sample of a packed row keep every stage's attention within the samples. With
    ``cp_mesh`` (context parallelism, ``context_parallel.pipeline_parts``) ``inputs`` hold this rank's part of the
    sequences (a composite model's first stage: the whole rows', :attr:`takes_whole_rows`) and the mask and
    positions the whole rows': the layers run in the all-gather attention's region over ``cp_mesh``, on the rank's
    positions, its mask built from the whole rows'. Multi-axis positions (Qwen-VL's 3-D rope) come rows first,
    ``[rows, axes, length]``, so that the schedule splits them with the rows; the stage hands the model
    ``[axes, rows, length]``. With :attr:`carry` (MTP heads), while training, ``carried`` tensors travel beside
    the hidden states: the first stage makes them, the middle ones pass them on, the last returns what the carry
    makes of them after its output. With :attr:`beside` (Qwen3-VL's DeepStack features) the tensors it names
    travel beside the hidden states from the first stage to the stages whose layers take them, while training and
    evaluating. ``mask_<name>`` keywords (per row: Gemma 3's ``token_type_ids``) are what the composite model builds
    its attention masks from (its images' tokens attend to each other both ways): the first stage hands them to the
    base model as ``<name>``, the later ones build the same masks from them (:meth:`_model_masks`), so every stage's
    layers attend as in the whole model; under context parallelism the all-gather attention's mask takes them as
    two-way spans instead (:attr:`spans_of`)."""

    # the loss applies the output head itself (FusedLinearCrossEntropy): no [tokens, vocab] logits leave the stage
    head_in_loss = False
    # what the stages carry beside the hidden states while training (automodel.mtp.pipeline.StageHeads: the MTP
    # heads' future-token embeddings, from the first stage to the last, which runs the heads); None: nothing
    carry: Any = None
    # what travels beside the hidden states to later stages' layers (automodel_vlm.deepstack.DeepStackTravel:
    # features the first stage's media make and some layers add): ``counts(stage)`` the tensors a stage takes and
    # sends; ``running(stage, taken, sent, cp_mesh)`` a context around the stage's model forward that appends what
    # it sends to ``sent`` (under context parallelism: this rank's part of the positions); None: nothing
    beside: Any = None
    # under context parallelism, the spans the all-gather attention lets attend both ways, from a micro-batch's
    # token types (``mask_*`` keywords): set by the domain (automodel_vlm.context_parallel.two_way_spans); None:
    # a stage given token types under context parallelism refuses them
    spans_of: Any = None

    def __init__(self, model: nn.Module, index: int, num_stages: int, layers: range, parts: dict[str, str],
                 whole: nn.Module | None = None):
        super().__init__()
        # the model the stage was cut from while the build pipeline runs (not a submodule): LoRA's targets are
        # resolved against it, so every stage adapts what one process would and adapter_config.json names them all
        object.__setattr__(self, "whole_model", whole if whole is not None else model)
        # the names save_pretrained gives the whole model's tensors where it renames them (the stage's keys are the
        # whole model's): the export writes a stage's tensors under them, as one process's save does
        self.hub_names = saved_names(self.whole_model)
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.tp_plan = dict(getattr(model, "tp_plan", None) or {})  # transformers' plan, for tensor parallelism
        self.index, self.num_stages, self.layer_range = index, num_stages, layers
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.head_name, self.embedding_name = parts["head"], parts["embedding"]  # the whole model's names
        self.base_model_prefix = self._base = model.base_model_prefix  # transformers' (peft's) weight mappings read it
        self._text = parts["layers"].rpartition(".")[0]  # the text model: what runs the later stages
        self.media_modules = list(parts["media"]) if index == 0 else []
        # transformers' rule for the masks its forward builds from the token types (a static method): the later
        # stages build the model's masks with it from the ``mask_*`` keywords (see forward)
        self._mask_rule = getattr(type(model), "create_masks_for_generate", None)
        for name, child in model.named_children():
            self.add_module(name, child)

    def forward(self, inputs: torch.Tensor, *carried: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cp_mesh: DeviceMesh | None = None,
                **media: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        types = {key[len(MASK_PREFIX):]: media.pop(key) for key in list(media) if key.startswith(MASK_PREFIX)}
        if position_ids is not None and position_ids.dim() == 3:  # multi-axis positions travel rows first
            position_ids = position_ids.transpose(0, 1)
        if self.is_first:  # the base model: a composite one encodes the media and merges them into the embeddings
            body, given = getattr(self, self._base), {"input_ids": inputs, **model_media(media), **types}
        else:
            body, given = self.get_submodule(self._text), {"inputs_embeds": inputs}
            if types and cp_mesh is None:  # the masks the composite model's forward builds from the token types
                attention_mask = self._model_masks(inputs, attention_mask, position_ids, types)
        spans = None
        if types and cp_mesh is not None:  # the all-gather attention's mask lets the spans attend both ways
            if self.spans_of is None:
                raise AutomodelError("distributed.cp_size: the pipeline stages build this model's masks from its "
                                     "token types, which the context-parallel attention does not take; set cp_size: 1")
            spans = self.spans_of(types)
        sent: list[torch.Tensor] = []
        with self.beside.running(self, carried, sent, cp_mesh) if self.beside is not None else contextlib.nullcontext():
            hidden = self._body(body, given, attention_mask, position_ids, cp_mesh, spans)
        output = self.output_head(hidden) if self.is_last and not self.head_in_loss else hidden
        if self.beside is not None:
            return (output, *sent) if sent else output
        if self.carry is None or not self.training:
            return output
        if self.is_first:
            carried = tuple(self.carry.embed(self, inputs))
        if self.is_last:
            return (output, *self.carry.run(self, hidden, carried, attention_mask, position_ids))
        return (output, *carried)

    def _body(self, body: nn.Module, given: dict[str, Any], attention_mask: Any, position_ids: torch.Tensor | None,
              cp_mesh: DeviceMesh | None, spans: Any = None) -> torch.Tensor:
        """The stage's model forward: its final hidden states (see :meth:`forward`; ``spans``: the all-gather
        attention's two-way spans)."""
        if cp_mesh is None:
            hidden = body(**given, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        else:  # this rank's part of the rows' sequences; their positions and padding are the whole rows'
            positions = split_sequence(position_ids, cp_mesh, dim=position_ids.dim() - 1)
            with all_gather_region(cp_mesh, position_ids.shape[-1], position_ids, attention_mask, [], spans):
                if self.takes_whole_rows:  # the media merged into the whole rows, the text model on the part
                    with self._text_model_on_part(cp_mesh, positions):
                        hidden = body(**given, attention_mask=attention_mask, position_ids=position_ids,
                                      use_cache=False).last_hidden_state
                else:
                    hidden = body(**given, position_ids=positions, use_cache=False).last_hidden_state
        return hidden

    def _model_masks(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, types: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The attention masks (by layer type) the composite model's forward builds from the micro-batch's token
        types (``types``: Gemma 3's ``token_type_ids``, Gemma 4's ``mm_token_type_ids``; its images' tokens attend
        to each other both ways) for its text model, by transformers' own rule for them (the model class's
        ``create_masks_for_generate``; the domain hands ``mask_*`` keywords only for models whose forward builds
        the same masks, and its tests compare the stages with the whole model)."""
        if self._mask_rule is None:
            raise AutomodelError(f"a pipeline stage was given {', '.join(MASK_PREFIX + key for key in types)}, but "
                                 f"the {self.config.model_type} model has no rule (create_masks_for_generate) that "
                                 "builds its masks from them; set pp_size: 1")
        return self._mask_rule(self.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                               position_ids=position_ids, **types)

    @property
    def takes_whole_rows(self) -> bool:
        """Whether, under context parallelism, the stage takes the whole rows' token ids: a composite model's first
        stage merges the media into the whole sequences (a row's images may lie on any rank's part) and its text
        model then runs on this rank's part of the merged embeddings (:meth:`_text_model_on_part`)."""
        return bool(self.media_modules)

    @contextlib.contextmanager
    def _text_model_on_part(self, cp_mesh: DeviceMesh, positions: torch.Tensor) -> Iterator[None]:
        """Within the block the text model gets this rank's part of the merged embeddings and of the positions the
        base model hands it (``positions``, the region's part of the whole rows', where it hands none), without an
        attention mask (the region's attention builds its own from the whole rows)."""
        def split(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            embeds, given = kwargs.get("inputs_embeds"), kwargs.get("position_ids")
            if embeds is None:
                raise AutomodelError(f"distributed.cp_size: the pipeline's first stage splits the embeddings the "
                                     f"model merges its media into, but '{type(module).__name__}' was called "
                                     "without inputs_embeds; set cp_size: 1 or pp_size: 1")
            part = positions if given is None else split_sequence(given, cp_mesh, dim=given.dim() - 1)
            return args, {**kwargs, "inputs_embeds": split_sequence(embeds, cp_mesh), "position_ids": part,
                          "attention_mask": None}

        handle = self.get_submodule(self._text).register_forward_pre_hook(split, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    @property
    def output_head(self) -> nn.Module | None:
        """The output head (the last stage's), None on the other stages."""
        return getattr(self, self.head_name) if self.is_last else None

    @property
    def input_embedding(self) -> nn.Module | None:
        """The input embedding (the first stage's), None on the other stages (not ``get_input_embeddings``, which
        peft would call on every stage)."""
        return self.get_submodule(self.embedding_name) if self.is_first else None

    def release_whole_model(self) -> None:
        """Drop the reference to the model the stage was cut from (built in full by a factory without meta-device
        support, it would stay in memory)."""
        object.__setattr__(self, "whole_model", None)

    def _init_weights(self, module: nn.Module) -> None:
        """The model's initialisation, for the head this stage holds outside the base model."""
        getattr(self, self._base)._init_weights(module)


def model_parts(model: nn.Module) -> dict[str, str]:
    """Names (relative to the causal LM) of its embedding, layers, head and the modules after the layers (the final
    norm), read from its pipeline plan; an ``AutomodelError`` when it has none this module understands."""
    plan = pipeline_plan(model)
    modules = dict(model.named_modules())
    parts: dict[str, Any] = {"after": []}
    for name, (inputs, outputs) in plan.items():
        if name not in modules:
            raise AutomodelError(f"the pipeline plan of '{type(model).__name__}' names '{name}', which it lacks")
        if "input_ids" in inputs:
            parts["embedding"] = name
        elif "logits" in outputs:
            parts["head"] = name
        elif isinstance(modules[name], nn.ModuleList):
            parts["layers"] = name
        else:
            parts["after"].append(name)
    head = model.get_output_embeddings() if "head" not in parts and hasattr(model, "get_output_embeddings") else None
    if head is not None:  # a composite model's plan (Llava's) names its text model's parts, not the head
        parts["head"] = next(name for name, module in modules.items() if module is head)
    missing = [part for part in ("embedding", "layers", "head") if part not in parts]
    if missing:
        raise AutomodelError(f"'{type(model).__name__}' has no pipeline plan naming its {', '.join(missing)} "
                             "(transformers' pp_plan); set distributed.pp_size: 1")
    if "." in parts["head"] or not parts["layers"].startswith(model.base_model_prefix + "."):
        raise AutomodelError(f"'{type(model).__name__}': the pipeline plan's head '{parts['head']}' or layers "
                             f"'{parts['layers']}' are not where a causal LM keeps them; set distributed.pp_size: 1")
    parts["media"] = media_modules(model, parts["layers"].rpartition(".")[0])
    parts["first"] = first_stage_only(model, parts["layers"].rpartition(".")[0])  # Gemma 4's per-layer inputs'
    return parts


def media_modules(model: nn.Module, text: str) -> list[str]:
    """The base model's children outside the text model ``text`` (a composite model's vision tower and projector):
    the first stage alone runs them (it merges the media into the embeddings); none where the base model is the
    text model (a causal LM)."""
    base = model.base_model_prefix
    if text == base:
        return []
    return [f"{base}.{name}" for name, _ in model.get_submodule(base).named_children()
            if not (text + ".").startswith(f"{base}.{name}.")]


def split_model(model: nn.Module, pp_rank: int, pp_size: int, stages_per_rank: int = 1
                ) -> list[PipelineStageModel]:
    """The stages rank ``pp_rank`` of ``pp_size`` runs (``stages_per_rank`` > 1 for interleaved schedules), each a
    pruned copy of ``model`` (on the meta device, before materialisation)."""
    if hasattr(model, "peft_config"):
        raise AutomodelError("the model factory returned a LoRA (peft) model, which pipeline stages cannot cut; "
                             "give LoRA in the peft: section (each stage gets its adapters) or set pp_size: 1")
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        raise AutomodelError("the model ties its output head to its input embedding, which pipeline stages hold "
                             "apart (first and last stage); give the head a weight of its own first "
                             "(pipeline_tied.untie_head)")
    parts = model_parts(model)
    num_stages = pp_size * stages_per_rank
    num_layers = len(model.get_submodule(parts["layers"]))
    ranges = stage_layer_ranges(num_layers, num_stages)
    stages = []
    for index in stage_indices(pp_rank, pp_size, stages_per_rank):
        stage = copy.deepcopy(model)
        layers = stage.get_submodule(parts["layers"])
        for number in range(num_layers):
            if number not in ranges[index]:
                placeholder = LayerPlaceholder()
                if hasattr(layers[number], "block_type"):  # Nemotron-H's forward picks each layer's mask by it
                    placeholder.block_type = layers[number].block_type
                layers[number] = placeholder
        if index != 0:
            for name in [parts["embedding"], *parts["media"], *parts.get("first", [])]:
                _replace(stage, name, None)
        if index != num_stages - 1:
            for name in parts["after"]:
                _replace(stage, name, LayerPlaceholder())
            _replace(stage, parts["head"], None)
            if isinstance(getattr(stage, "mtp", None), nn.Module):  # the MTP heads run on the last stage
                _replace(stage, "mtp", None)
        stages.append(PipelineStageModel(stage, index, num_stages, ranges[index], parts, whole=model))
    return stages


def _replace(model: nn.Module, name: str, module: nn.Module | None) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


class LocalStages(nn.Module):
    """The stages one pipeline rank runs (interleaved schedules), as one module under the causal LM's names: each
    submodule is the stage's own (its embedding, layers, norm, head; the modules every stage holds, parameterless
    like the rotary embedding, from the first), so ``parameters()`` and ``state_dict()`` are the stages' together
    and a checkpoint is keyed as the one model's. It has no forward: the schedule runs :attr:`stages`, each still
    its own FSDP2 root and its own torch pipeline stage."""

    def __init__(self, stages: list[PipelineStageModel]):
        super().__init__()
        self.stages = tuple(stages)  # not submodules: state_dict holds the merged tree only
        self.config, self.generation_config = stages[0].config, stages[0].generation_config
        if hasattr(stages[0], "peft_config"):  # LoRA on each stage: one adapter, under the one model's peft names
            self.peft_config = stages[0].peft_config
        for name, child in _merged_children(list(stages)).items():
            self.add_module(name, child)

    def train(self, mode: bool = True) -> LocalStages:
        """Also the stages' own containers (the root and base model each stage runs forward through)."""
        for stage in self.stages:
            stage.train(mode)
        return super().train(mode)


def stages_of(model: nn.Module) -> list[nn.Module]:
    """The stages ``model`` (a stage, a LoRA-wrapped stage, or a rank's :class:`LocalStages`) runs."""
    return list(model.stages) if isinstance(model, LocalStages) else [model]


def is_stage(model: nn.Module) -> bool:
    """Whether ``model`` holds pipeline stages only, some layers of the model: one stage, one wrapped by peft (LoRA's
    ``PeftModel`` around it) or a rank's :class:`LocalStages`."""
    return isinstance(_inside_peft(model), (PipelineStageModel, LocalStages))


def stage_models(model: nn.Module) -> list[nn.Module]:
    """The :class:`PipelineStageModel` s ``model`` (what :func:`stages_of` takes) runs, inside their LoRA wrappers."""
    return [_inside_peft(stage) for stage in stages_of(model)]


def last_stage(model: nn.Module) -> PipelineStageModel | None:
    """The pipeline's last stage where this rank runs it (``model``: what :func:`stages_of` takes), else None."""
    return next((stage for stage in stage_models(model) if isinstance(stage, PipelineStageModel) and stage.is_last),
                None)


def _inside_peft(model: nn.Module) -> nn.Module:
    """The model a peft ``PeftModel`` wraps (``model`` itself where it is none)."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def _merged_children(modules: list[nn.Module]) -> dict[str, nn.Module | None]:
    """Child name -> the merge of that child over ``modules`` (several copies of one container)."""
    names = dict.fromkeys(name for module in modules for name in module._modules)
    return {name: _merge([module._modules.get(name) for module in modules]) for name in names}


def _merge(copies: list[nn.Module | None]) -> nn.Module | None:
    """One module for what several stages hold at one place: the one stage's module where only one holds a real
    module there, else (a container every stage keeps) a container of the merged children; a placeholder where none
    holds one."""
    real = [m for m in copies if m is not None and not isinstance(m, LayerPlaceholder)]
    if not real:
        return next((m for m in copies if m is not None), None)
    if len(real) == 1:
        return real[0]
    if not any(m._modules for m in real):
        if any(True for m in real for _ in m.parameters()):
            raise AutomodelError(f"{len(real)} pipeline stages of one rank each hold a '{type(real[0]).__name__}' "
                                 "with parameters; each parameter must belong to one stage")
        return real[0]  # parameterless, the same in every stage (the rotary embedding)
    if any(m._parameters for m in real):
        raise AutomodelError(f"{len(real)} pipeline stages of one rank each hold parameters of a "
                             f"'{type(real[0]).__name__}'; each parameter must belong to one stage")
    merged = nn.ModuleList() if isinstance(real[0], nn.ModuleList) else nn.Module()
    for name, child in _merged_children(real).items():
        merged.add_module(name, child)
    for name, buffer in real[0]._buffers.items():
        merged.register_buffer(name, buffer, persistent=name not in real[0]._non_persistent_buffers_set)
    return merged
