"""Tensor (and sequence) parallelism of a Hugging Face causal LM over the mesh's ``tp`` dimension, with DTensor.

:func:`apply_tensor_parallel` shards the model in place with ``parallelize_module`` following its plan
(:mod:`automodel.training.parallel.tp_plans`), on the meta device (before :func:`materialize`, which then reads
each rank's slices) or on a materialised model. Order in the build: meta build -> LoRA -> TP -> activation
checkpointing -> FSDP2 over the data-parallel mesh (a 2-D ``dp x tp`` layout) -> materialise.

Where the plan shards the output head over the vocabulary, the logits stay a ``DTensor`` sharded over the
vocabulary (no rank holds a whole row of them) and the cross entropy runs vocabulary-parallel inside
:meth:`TensorParallel.loss_context` (torch's ``loss_parallel``), which must hold the loss computation and its
backward; :func:`local_loss` turns the resulting loss into a plain tensor. Summed over the label tokens like the
engine's, it is then divided by the step's label tokens exactly as without TP. The ranks of one ``tp`` group read
the same batch: the loss's token count and reduction run over the data-parallel group only.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.parallel.blocks import clean_name, is_pipeline_stage, transformer_blocks
from automodel.training.parallel.tp_plans import (
    EXPERTS_STYLE,
    HEAD_STYLES,
    STYLES,
    TP_PLANS,
    TPPlanRegistry,
    config_plan,
    expand_plan,
    model_plan,
    sequence_parallel_entries,
    torch_styles,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_KEY_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "query_key_value")
SEQUENCE_PARALLEL_EXPERTS = ("true would run the mixture-of-experts layers on each rank's part of the sequence, but "
                             "their experts stay whole on every tensor-parallel rank (not split by the plan), so "
                             "their input would have to be gathered and their output split again, which is not "
                             "built; set it to false")


@dataclass(frozen=True)
class TensorParallel:
    """What :func:`apply_tensor_parallel` did: the plan per module and how the loss must be computed."""

    tp_size: int
    plan: dict[str, str] = field(default_factory=dict)  # module name -> style name
    vocab_parallel: bool = False  # the logits are a DTensor sharded over the vocabulary
    sequence_parallel: bool = False
    # whether a loss_context is open: outside one, the head gathers the logits (generation, any caller's forward)
    _in_loss: list[bool] = field(default_factory=lambda: [False], repr=False, compare=False)

    @contextlib.contextmanager
    def loss_context(self) -> Iterator[None]:
        """Around the loss computation and its backward: ``loss_parallel`` when the logits are vocab-parallel (they
        stay sharded only inside it; a forward outside it returns whole logits as a plain tensor)."""
        if not self.vocab_parallel:
            yield
            return
        from torch.distributed.tensor.parallel import loss_parallel

        self._in_loss[0] = True
        try:
            with loss_parallel():
                yield
        finally:
            self._in_loss[0] = False

    def _head_output(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The head's forward hook: the logits gathered over the vocabulary outside :meth:`loss_context`."""
        from torch.distributed.tensor import DTensor

        return output.full_tensor() if isinstance(output, DTensor) and not self._in_loss[0] else output

    def describe(self) -> list[str]:
        """Lines for ``--dry-run``: the plan with layer indices folded to ``*``."""
        return describe_plan(self.plan, self.tp_size, self.sequence_parallel, self.vocab_parallel)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                          vocab_parallel: bool = True, registry: TPPlanRegistry = TP_PLANS) -> TensorParallel:
    """Shard ``model`` (a causal LM or one pipeline stage of it) in place over the 1-D mesh ``tp_mesh``.

    ``vocab_parallel``: keep the logits sharded over the vocabulary where the plan shards the head (else they are
    gathered on every rank). A pipeline stage (its missing layers are placeholders) lacks modules the plan names;
    only those it holds are sharded."""
    from torch.distributed.tensor.parallel import parallelize_module

    wrapper = model
    if hasattr(model, "peft_config"):
        model = model.get_base_model()  # the plan names the base model's modules
    plan = model_plan(model, registry)
    is_stage = is_pipeline_stage(model)
    concrete = _with_lora_layers(model, expand_plan(plan, model, require_all=not is_stage))
    head = _head_name(model)
    vocab_parallel = vocab_parallel and concrete.get(head) in HEAD_STYLES
    ties = _tied_parameters(model)
    styles = torch_styles(concrete, head if vocab_parallel else None)
    if sequence_parallel and EXPERTS_STYLE in concrete.values():
        raise AutomodelError(f"distributed.sequence_parallel: {SEQUENCE_PARALLEL_EXPERTS}")
    if sequence_parallel:
        names = {id(module): name for name, module in model.named_modules()}
        styles.update(sequence_parallel_entries(concrete, [(names[id(b)], b) for b in transformer_blocks(model)]))
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    _retie(model, ties)
    for name in frozen:  # torch's SequenceParallel re-registers a norm's weight as trainable (a LoRA run's base)
        model.get_parameter(name).requires_grad_(False)
    applied = TensorParallel(tp_mesh.size(), concrete, vocab_parallel, sequence_parallel)
    if vocab_parallel:
        model.get_submodule(head).register_forward_hook(applied._head_output)
    _APPLIED[model] = applied
    _APPLIED[wrapper] = applied
    return applied


# base layer's style -> the adapter matrix sharded with it: the one whose output (lora_B) or input (lora_A) features
# are the base's sharded ones
_LORA_SHARDED = {"colwise": "lora_B", "local_colwise": "lora_B", "colwise_gather_output": "lora_B",
                 "colwise_rep": "lora_B", "rowwise": "lora_A", "local_rowwise": "lora_A",
                 "rowwise_split_input": "lora_A", "rowwise_rep": "lora_A"}


def _with_lora_layers(model: nn.Module, concrete: dict[str, str]) -> dict[str, str]:
    """``concrete`` with each entry on a peft LoRA layer replaced by its base layer and the adapter matrix that
    shares its sharded dimension: a column-wise base (output features sharded) gets ``lora_B`` column-wise and
    ``lora_A`` replicated; a row-wise one (input features sharded) ``lora_A`` row-wise and ``lora_B`` replicated.
    The adapter matrix takes the base's style as it is, so it adds its output shard, its gathered output
    (``colwise_gather_output``) or its all-reduced output as the base layer does."""
    out: dict[str, str] = {}
    for name, style in concrete.items():
        module = model.get_submodule(name)
        adapters = getattr(module, "lora_A", None)
        whole = STYLES[style][1](False) is None  # replicated over the ranks (whole experts): so are its adapters
        if whole or not isinstance(adapters, nn.ModuleDict) or not hasattr(module, "base_layer"):
            out[name] = style
            continue
        sharded = _LORA_SHARDED.get(style)
        if sharded is None or not isinstance(module.base_layer, nn.Linear) \
                or any(getattr(module, "use_dora", {}).values()):
            raise AutomodelError(f"LoRA on '{clean_name(name)}', which the tensor-parallel plan shards '{style}', "
                                 "is not supported: LoRA under tensor parallelism adapts column-wise or row-wise "
                                 "nn.Linear projections only (not DoRA); leave it out of peft.target_modules "
                                 "(peft.exclude_modules) or set distributed.tp_size: 1")
        out[f"{name}.base_layer"] = style
        for adapter in adapters:
            out[f"{name}.{sharded}.{adapter}"] = style
    return out


# model -> what apply_tensor_parallel did to it: the training loop asks (tensor_parallel_of) how to compute the loss
_APPLIED: weakref.WeakKeyDictionary[nn.Module, TensorParallel] = weakref.WeakKeyDictionary()


def tensor_parallel_of(model: nn.Module) -> TensorParallel | None:
    """What :func:`apply_tensor_parallel` did to ``model`` (the unwrapped model), None when it is not sharded so."""
    return _APPLIED.get(model)


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed vocabulary-parallel (a replicated ``DTensor``) as a plain tensor, differentiably."""
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _head_name(model: nn.Module) -> str | None:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return next((name for name, module in model.named_modules() if module is head), None) if head is not None \
        else None


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) holding one parameter: ``parallelize_module`` gives each its own copy."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def _retie(model: nn.Module, ties: list[list[tuple[nn.Module, str]]]) -> None:
    names = {id(module): name for name, module in model.named_modules()}
    for (first, first_attr), *others in ties:
        param = first._parameters[first_attr]
        for module, attr in others:
            other = module._parameters[attr]
            if _placements(other) != _placements(param):
                raise AutomodelError(
                    f"'{clean_name(names[id(module)])}.{attr}' is tied to '{clean_name(names[id(first)])}."
                    f"{first_attr}', but the tensor-parallel plan shards them differently ({_placements(other)} vs "
                    f"{_placements(param)}); untie them (tie_word_embeddings: false) or shard both alike")
            module._parameters[attr] = param


def _placements(tensor: torch.Tensor) -> tuple:
    return tuple(getattr(tensor, "placements", ()))


# ---- validation and description --------------------------------------------------------------------------------


def tp_issues(model_config: Any, tp_size: int, sequence_parallel: bool = False, registry: TPPlanRegistry = TP_PLANS,
              section: str = "distributed") -> list[ConfigIssue]:
    """Whether ``model_config``'s architecture can be split over ``tp_size`` ranks, each problem with the numbers."""
    key = f"{section}.tp_size"
    if tp_size == 1:
        return []
    plan = config_plan(model_config, registry)
    if plan is None:
        return [ConfigIssue(key, f"{tp_size}: the model ({model_config.model_type}) has no tensor-parallel plan (no "
                                 "base_model_tp_plan in its config, none registered by a plugin); set tp_size: 1")]
    unsupported = sorted({f"{pattern} ({style})" for pattern, style in plan.items() if style not in STYLES})
    if unsupported:
        return [ConfigIssue(key, f"{tp_size}: the {model_config.model_type} tensor-parallel plan uses styles not "
                                 f"supported here: {', '.join(unsupported)}; set tp_size: 1")]
    text = getattr(model_config, "get_text_config", lambda: model_config)()
    styles = set(plan.values())
    sizes = [("num_attention_heads", "attention heads")]
    if any(pattern.rsplit(".", 1)[-1] in _KEY_PROJECTIONS for pattern, style in plan.items()
           if style in ("colwise", "local_colwise")):
        sizes.append(("num_key_value_heads", "key/value heads"))
    if styles & {"colwise", "rowwise", "local_colwise", "local_rowwise"}:
        sizes.append(("intermediate_size", "MLP intermediate size"))
    own_plan = model_config.model_type not in registry  # transformers adds a vocabulary-parallel embedding to it
    if own_plan or styles & {"embedding_rowwise", *HEAD_STYLES}:
        sizes.append(("vocab_size", "vocabulary size"))
    if "embedding_colwise" in styles:
        sizes.append(("hidden_size", "hidden size"))
    issues = _indivisible(text, sizes, tp_size, key, "the model's")
    if model_config.model_type not in registry:  # the model's own plan: its towers' plans too (Gemma 4's vision)
        issues += _tower_issues(model_config, tp_size, key)
    if sequence_parallel and not styles & {"rowwise", "local_rowwise"}:
        issues.append(ConfigIssue(f"{section}.sequence_parallel", "true needs a plan with row-wise projections, "
                                  f"which the {model_config.model_type} plan lacks; set it to false"))
    elif sequence_parallel and EXPERTS_STYLE in styles:
        issues.append(ConfigIssue(f"{section}.sequence_parallel", SEQUENCE_PARALLEL_EXPERTS))
    return issues


def _tower_issues(model_config: Any, tp_size: int, key: str) -> list[ConfigIssue]:
    """The sizes ``tp_size`` must divide in a vision or audio tower that has a tensor-parallel plan of its own
    (transformers gathers it into the composite model's, so the build shards the tower too)."""
    sizes = [("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads"),
             ("intermediate_size", "MLP intermediate size")]
    issues = []
    for name, tower in (("vision_config", "vision tower"), ("audio_config", "audio tower")):
        sub = getattr(model_config, name, None)
        if sub is not None and getattr(sub, "base_model_tp_plan", None):
            issues += _indivisible(sub, sizes, tp_size, key, f"the {tower}'s", f"{name}.",
                                   ", which its own plan shards too")
    return issues


def _indivisible(config: Any, sizes: list[tuple[str, str]], tp_size: int, key: str, owner: str, prefix: str = "",
                 why: str = "") -> list[ConfigIssue]:
    """An issue for each of ``sizes`` (attribute, what it counts) of ``config`` that ``tp_size`` does not divide."""
    issues = []
    for attr, what in sizes:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value % tp_size:
            issues.append(ConfigIssue(key, f"{tp_size} does not divide {owner} {what} ({prefix}{attr} = {value}){why}"
                                           f"; use a tp_size that divides {value}"))
    return issues


def describe_plan(plan: dict[str, str], tp_size: int, sequence_parallel: bool, vocab_parallel: bool) -> list[str]:
    """The plan with layer indices folded (``model.layers.*.mlp.up_proj: colwise (...) x 32``)."""
    folded: dict[tuple[str, str], int] = {}
    for name, style in plan.items():
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        folded[(pattern, style)] = folded.get((pattern, style), 0) + 1
    head = f"tensor parallel over tp {tp_size}" + (", sequence parallel" if sequence_parallel else "") + \
        (", vocabulary-parallel loss" if vocab_parallel else "")
    lines = [head]
    for (pattern, style), count in folded.items():
        lines.append(f"  {pattern}: {style} ({STYLES[style][0]})" + (f" x {count}" if count > 1 else ""))
    return lines

