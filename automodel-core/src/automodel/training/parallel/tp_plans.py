"""Tensor-parallel plans: which module of a Hugging Face causal LM is sharded how, as torch ``ParallelStyle``\\ s.

A plan maps module-name patterns (``fnmatch``, relative to the causal LM: ``model.layers.*.self_attn.q_proj``) to
style names. The names are transformers' own, so a model's ``tp_plan`` (its config's ``base_model_tp_plan`` plus
the head's ``_tp_plan``, which transformers 5.x merges and extends with a vocabulary-parallel ``embed_tokens``) is
used as it is; :data:`STYLES` says what each name means in torch's terms (5.x names and the 4.x ones).
:class:`TPPlanRegistry` holds plans per ``model_type`` for architectures whose config has none, or to replace it; a
plugin adds its own through the registry (``register(model_type, plan)``).

Every style returns local tensors between modules, so the model's own code computes on this rank's part: an
attention's ``q_proj`` output holds this rank's heads and transformers' attention, which reshapes with ``-1``
heads, sees the local head count. With ``sequence_parallel`` (:func:`sequence_parallel_entries`) the residual
stream inside the decoder layers holds this rank's part of the sequence: norms (and dropouts) run on it
(``SequenceParallel``), each attention / MLP gathers its input over the sequence and its row-wise output
projection reduce-scatters back; the stage's first layer splits its input and its last gathers its output, so
embeddings, rotary positions, masks and the head see the whole sequence.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from automodel.errors import AutomodelError

_SEQUENCE = Shard(1)


class ReplicateWithGradSum(ParallelStyle):
    """A replicated module that runs on this rank's part of its input (a per-head norm on the local heads): its
    parameters become replicated ``DTensor``\\ s and its input is declared split across the ranks, so DTensor sums
    the parameters' gradients over the ranks. The module must act on each position on its own (a norm over the last
    dimension); which dimension the input is declared split on then changes nothing but the gradient's reduction."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def replicate(name: str, part: nn.Module, mesh: Any) -> None:
            for key, param in list(part.named_parameters(recurse=False)):
                part.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Replicate()],
                                                                            src_data_rank=None),
                                                          requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, replicate,
                                 input_fn=lambda mod, inputs, mesh: _as_dtensor(inputs, mesh, Shard(0)),
                                 output_fn=lambda mod, output, mesh: output.to_local())


class SequenceLayout(ParallelStyle):
    """Converts a module's ``hidden_states`` (first positional argument or keyword) between the whole sequence and
    this rank's part: ``gather`` (into an attention / MLP under sequence parallelism) or ``split`` (into a stage's
    first decoder layer). The module sees a local tensor."""

    def __init__(self, direction: str):
        self.source, self.target = (_SEQUENCE, Replicate()) if direction == "gather" else (Replicate(), _SEQUENCE)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (_convert(args[0], device_mesh, self.source, self.target), *args[1:]), kwargs
            hidden = _convert(kwargs["hidden_states"], device_mesh, self.source, self.target)
            return args, {**kwargs, "hidden_states": hidden}

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module


def _convert(value: Any, mesh: Any, source: Any, target: Any) -> Any:
    """``value`` (local, laid out as ``source``, or a DTensor) redistributed to ``target``, as a local tensor."""
    if not isinstance(value, DTensor):
        value = DTensor.from_local(value, mesh, [source], run_check=False)
    if target == _SEQUENCE and value.shape[1] % mesh.size():
        raise AutomodelError(f"sequence parallelism splits the sequence over tp_size {mesh.size()} ranks, but this "
                             f"batch's sequences have {value.shape[1]} positions; pad them to a multiple of "
                             f"{mesh.size()}")
    return value.redistribute(placements=[target]).to_local()


def _as_dtensor(inputs: tuple, mesh: Any, placement: Any) -> tuple:
    first, *rest = inputs
    if not isinstance(first, DTensor):
        first = DTensor.from_local(first, mesh, [placement], run_check=False)
    return (first, *rest)


class OwnOutput(ParallelStyle):
    """``style`` with its output copied into a tensor of its own instead of a view of the DTensor's local tensor. An
    embedding's output enters the first transformer block, which may be compiled: ``torch.compile`` takes such a view
    as an alias of its input and its backward then loses the gradient's layout (DTensor's backward fails, or under
    FSDP2 the gradients come out wrong)."""

    def __init__(self, style: ParallelStyle):
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module = self.style._apply(module, device_mesh)
        module.register_forward_hook(lambda mod, args, output: output.clone())
        return module


def _gathered_colwise(vocab_parallel: bool) -> ParallelStyle:
    """Column-wise with the output gathered on every rank; on the output head with ``vocab_parallel``, the logits
    stay sharded over the vocabulary instead (a DTensor, for ``loss_parallel``)."""
    if vocab_parallel:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(output_layouts=Replicate())


# Style name -> (what it does, a factory taking ``vocab_parallel``: whether the module is the output head whose logits
# stay vocabulary-parallel). 4.x names beside 5.x ones of the same meaning.
STYLES: dict[str, tuple[str, Callable[[bool], ParallelStyle | None]]] = {
    "colwise": ("column-wise: output features sharded", lambda vp: ColwiseParallel()),
    "local_colwise": ("column-wise: output features sharded", lambda vp: ColwiseParallel()),
    "rowwise": ("row-wise: input features sharded, output all-reduced", lambda vp: RowwiseParallel()),
    "local_rowwise": ("row-wise: input features sharded, output all-reduced", lambda vp: RowwiseParallel()),
    "colwise_rep": ("column-wise, output gathered (the head: vocabulary-parallel logits)", _gathered_colwise),
    "colwise_gather_output": ("column-wise, output gathered (the head: vocabulary-parallel logits)",
                              _gathered_colwise),
    "rowwise_rep": ("row-wise on a replicated input", lambda vp: RowwiseParallel(input_layouts=Replicate())),
    "rowwise_split_input": ("row-wise on a replicated input", lambda vp: RowwiseParallel(input_layouts=Replicate())),
    "embedding_rowwise": ("vocabulary-parallel embedding", lambda vp: OwnOutput(
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))),
    "embedding_colwise": ("embedding with the hidden size sharded", lambda vp: OwnOutput(
        ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))),
    "gather": ("output all-reduced", lambda vp: PrepareModuleOutput(output_layouts=Partial(),
                                                                    desired_output_layouts=Replicate())),
    "all_reduce": ("output all-reduced", lambda vp: PrepareModuleOutput(output_layouts=Partial(),
                                                                        desired_output_layouts=Replicate())),
    "replicated_with_grad_allreduce": ("replicated, gradients summed over the ranks",
                                       lambda vp: ReplicateWithGradSum()),
    "sequence_parallel": ("sequence-parallel (norm, dropout)", lambda vp: SequenceParallel(use_local_output=True)),
    "replicate": ("replicated", lambda vp: None),
    # transformers' plan for a mixture-of-experts layer's fused experts splits every expert's intermediate features
    # (its packed gate_up_proj with a strided layout DCP cannot checkpoint): here they stay whole on each tp rank
    "moe_tp_experts": ("experts whole on every tensor-parallel rank (FSDP2 shards them over the data-parallel "
                       "ranks, distributed.ep_size splits them by expert)", lambda vp: None),
}
EXPERTS_STYLE = "moe_tp_experts"
HEAD_STYLES = ("colwise_rep", "colwise_gather_output")
ROWWISE_STYLES = ("rowwise", "local_rowwise")


class TPPlanRegistry:
    """Tensor-parallel plans by ``config.model_type``; an entry wins over the model's own ``tp_plan``."""

    def __init__(self) -> None:
        self._plans: dict[str, dict[str, str]] = {}

    def register(self, model_type: str, plan: Mapping[str, str]) -> None:
        """Add (or replace) the plan of ``model_type``: module pattern -> a style name of :data:`STYLES`."""
        unknown = sorted({style for style in plan.values() if style not in STYLES})
        if unknown:
            raise AutomodelError(f"the tensor-parallel plan for '{model_type}' names unknown styles "
                                 f"{', '.join(unknown)}; known: {', '.join(STYLES)}")
        self._plans[model_type] = dict(plan)

    def get(self, model_type: str) -> dict[str, str] | None:
        plan = self._plans.get(model_type)
        return dict(plan) if plan is not None else None

    def __contains__(self, model_type: str) -> bool:
        return model_type in self._plans


TP_PLANS = TPPlanRegistry()


def config_plan(config: Any, registry: TPPlanRegistry = TP_PLANS) -> dict[str, str] | None:
    """The plan validation can see without a model: the registry's, else the config's ``base_model_tp_plan`` (a
    composite config's, such as Llava's, is its text config's: the built model shards its language model by it)."""
    own = getattr(config, "base_model_tp_plan", None)
    if not own and hasattr(config, "get_text_config"):
        own = getattr(config.get_text_config(), "base_model_tp_plan", None)
    plan = registry.get(config.model_type) or (dict(own or {}) or None)
    return _fitted(plan, config) if plan else plan


def _fitted(plan: Mapping[str, str], config: Any) -> dict[str, str]:
    return with_whole_experts(without_read_embeddings(without_absent_experts(plan, config), config))


def with_whole_experts(plan: Mapping[str, str]) -> dict[str, str]:
    """``plan`` less the entries for the weights of an experts module it shards ``moe_tp_experts``
    (``layers.*.mlp.experts.gate_up_proj: packed_colwise``, ``...down_proj: rowwise``): those experts stay whole on
    every tensor-parallel rank (see :data:`STYLES`), and every rank computes all of them on the same tokens."""
    experts = {pattern for pattern, style in plan.items() if style == EXPERTS_STYLE}
    return {pattern: style for pattern, style in plan.items() if pattern.rpartition(".")[0] not in experts}


def without_read_embeddings(plan: Mapping[str, str], config: Any) -> dict[str, str]:
    """``plan`` less its vocabulary-parallel ``embed_tokens`` where the model's own code reads rows of that weight
    directly: Gemma 4's per-layer inputs (``hidden_size_per_layer_input``) take the pad token's row and compare
    embeddings with the whole weight, which a shard of the vocabulary cannot give. That embedding stays whole on
    every tensor-parallel rank (FSDP2 still shards it over the data-parallel ones), and so does an output head tied
    to it (its logits are then whole too)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "hidden_size_per_layer_input", 0):
        return dict(plan)
    tied = getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)
    return {pattern: style for pattern, style in plan.items()
            if not (pattern.split(".")[-1] == "embed_tokens" and style.startswith("embedding"))
            and not (tied and style in HEAD_STYLES)}


def without_absent_experts(plan: Mapping[str, str], config: Any) -> dict[str, str]:
    """``plan`` less its entries for experts modules when ``config`` says its model has no routed experts: one
    model type's plan may cover its dense and its mixture-of-experts variants (Gemma 4's), and the dense model has
    no experts module for those entries to shard."""
    from automodel.training.parallel.expert_parallel import config_declares_no_experts

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not config_declares_no_experts(text):
        return dict(plan)
    return {pattern: style for pattern, style in plan.items() if "experts" not in pattern.split(".")}


def model_plan(model: nn.Module, registry: TPPlanRegistry = TP_PLANS) -> dict[str, str]:
    """The plan of a built causal LM: the registry's entry for its ``model_type``, else the model's own."""
    plan = registry.get(model.config.model_type) or dict(getattr(model, "tp_plan", None) or {})
    plan = _fitted(plan, model.config)
    if not plan:
        raise AutomodelError(f"'{type(model).__name__}' ({model.config.model_type}) has no tensor-parallel plan (no "
                             "base_model_tp_plan in its config, none registered); set distributed.tp_size: 1 or "
                             "register a plan for this architecture")
    return plan


def expand_plan(plan: Mapping[str, str], model: nn.Module, require_all: bool = True) -> dict[str, str]:
    """Module name -> style name for every module of ``model`` that ``plan`` shards (the first pattern matching
    a module wins, as in transformers). Every style must be one of :data:`STYLES`; ``require_all``: every pattern
    must match a module (a pipeline stage holds only some of them), or name a child its parent modules lack (a
    plan covering a layer variant the model does not have: Qwen3-MoE's dense-MLP entries when every layer's MLP is
    a mixture of experts)."""
    names = [name for name, _ in model.named_modules() if name]
    concrete: dict[str, str] = {}
    for pattern, style_name in plan.items():
        if style_name not in STYLES:
            raise AutomodelError(f"the tensor-parallel plan of '{type(model).__name__}' shards '{pattern}' with "
                                 f"'{style_name}', which is not supported here (supported: {', '.join(STYLES)})")
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        parent = pattern.rpartition(".")[0]
        variant = any(fnmatch.fnmatchcase(name, parent) for name in names)  # the parent lacks it: another variant's
        if not matched and require_all and not variant:
            raise AutomodelError(f"the tensor-parallel plan names '{pattern}', which matches no module of "
                                 f"'{type(model).__name__}': is the plan for this architecture?")
        for name in matched:
            concrete.setdefault(name, style_name)
    return concrete


def torch_styles(concrete: Mapping[str, str], vocab_parallel_head: str | None = None) -> dict[str, ParallelStyle]:
    """An expanded plan as ``parallelize_module`` takes it (replicated modules left out). ``vocab_parallel_head``:
    the output head's name when its logits stay sharded over the vocabulary; every other module sharded by a head
    style (Phi-3's ``qkv_proj``, OLMo 2's ``q_proj``: ``colwise_gather_output``) gathers its output."""
    styles = {name: STYLES[style_name][1](name == vocab_parallel_head) for name, style_name in concrete.items()}
    return {name: style for name, style in styles.items() if style is not None}


def sequence_parallel_entries(concrete: Mapping[str, str], layers: Iterable[tuple[str, nn.Module]]
                              ) -> dict[str, ParallelStyle]:
    """The styles that shard the residual stream over the sequence inside ``layers`` (name, decoder layer), to
    add to (and replace entries of) :func:`torch_styles`. The layers are those of one pipeline stage, in order."""
    layers = list(layers)
    entries: dict[str, ParallelStyle] = {}
    for index, (name, layer) in enumerate(layers):
        for child_name, child in layer.named_children():
            full = f"{name}.{child_name}"
            if _is_norm_or_dropout(child):
                entries[full] = SequenceParallel(use_local_output=True)
                continue
            inside = {sub: concrete[sub] for sub, _ in child.named_modules(prefix=full)
                      if concrete.get(sub, "replicate") != "replicate"}
            if not inside and any(True for _ in child.parameters()):
                raise AutomodelError(f"sequence parallelism: '{full}' ({type(child).__name__}) holds parameters but "
                                     "no tensor-parallel projection, so it cannot run on a part of the sequence; "
                                     "set distributed.sequence_parallel: false")
            if inside:
                entries[full] = SequenceLayout("gather")
                rowwise = [sub for sub, style in inside.items() if style in ROWWISE_STYLES]
                entries.update({sub: RowwiseParallel(output_layouts=_SEQUENCE) for sub in rowwise})
                entries.update({adapter: ReplicateWithGradSum() for adapter in _lora_b_after(rowwise)})
        entries[name] = LayerSequenceBoundary(split_input=index == 0, gather_output=index == len(layers) - 1)
    return entries


_LORA_A = re.compile(r"(?P<layer>.+)\.lora_A\.(?P<adapter>[^.]+)")  # peft's adapter matrix names


def _lora_b_after(rowwise: Iterable[str]) -> list[str]:
    """The LoRA ``lora_B`` matrices that follow a row-wise sharded ``lora_A``. Under sequence parallelism that
    ``lora_A``'s output is reduce-scattered over the sequence like its base layer's, so ``lora_B`` runs on this
    rank's part of the sequence: a replicated matrix whose gradient is summed over the ranks."""
    matches = [_LORA_A.fullmatch(name) for name in rowwise]
    return [f"{m['layer']}.lora_B.{m['adapter']}" for m in matches if m]


class LayerSequenceBoundary(ParallelStyle):
    """A decoder layer at the edge of the sequence-parallel region: the stage's first splits its input over the
    sequence, its last gathers its output (a layer in between passes its sequence part on unchanged)."""

    def __init__(self, split_input: bool, gather_output: bool):
        self.split_input, self.gather_output = split_input, gather_output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if self.split_input:
            SequenceLayout("split")._apply(module, device_mesh)
        if self.gather_output:
            # A copy, not DTensor's view of the gathered tensor: the layer may be an FSDP unit, whose output must
            # not be a view (an in-place op on it would skip FSDP's pre-backward hook).
            module.register_forward_hook(
                lambda mod, args, output: _convert(output, device_mesh, _SEQUENCE, Replicate()).clone())
        return module


def _is_norm_or_dropout(module: nn.Module) -> bool:
    kind = type(module).__name__
    return isinstance(module, (nn.Dropout, nn.LayerNorm)) or "Norm" in kind or "Dropout" in kind
