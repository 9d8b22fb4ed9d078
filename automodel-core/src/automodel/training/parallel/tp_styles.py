"""The torch ``ParallelStyle`` of each tensor-parallel style name of :mod:`automodel.training.parallel.tp_plans`,
and the sequence-parallel styles (see tp_plans' docstring for what they do). Imported where a model is sharded, not
at validation: ``torch.distributed.tensor`` takes a while to import.
"""

from __future__ import annotations

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
from automodel.training.parallel.tp_plans import ROWWISE_STYLES

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


def _vocab_head(vocab_parallel: bool) -> ParallelStyle:
    """The output head: logits sharded over the vocabulary (for ``loss_parallel``) or gathered on every rank."""
    if vocab_parallel:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(output_layouts=Replicate())


# Style name (tp_plans.STYLES) -> a factory of its torch style, taking ``vocab_parallel`` (None: replicated).
STYLE_FACTORIES: dict[str, Callable[[bool], ParallelStyle | None]] = {
    "colwise": lambda vp: ColwiseParallel(),
    "local_colwise": lambda vp: ColwiseParallel(),
    "rowwise": lambda vp: RowwiseParallel(),
    "local_rowwise": lambda vp: RowwiseParallel(),
    "colwise_rep": _vocab_head,
    "colwise_gather_output": _vocab_head,
    "rowwise_rep": lambda vp: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda vp: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda vp: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "embedding_colwise": lambda vp: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "gather": lambda vp: PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
    "all_reduce": lambda vp: PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda vp: ReplicateWithGradSum(),
    "sequence_parallel": lambda vp: SequenceParallel(use_local_output=True),
    "replicate": lambda vp: None,
}


def torch_styles(concrete: Mapping[str, str], vocab_parallel: bool) -> dict[str, ParallelStyle]:
    """An expanded plan as ``parallelize_module`` takes it (replicated modules left out)."""
    styles = {name: STYLE_FACTORIES[style_name](vocab_parallel) for name, style_name in concrete.items()}
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
                entries.update({sub: RowwiseParallel(output_layouts=_SEQUENCE) for sub, style in inside.items()
                                if style in ROWWISE_STYLES})
        entries[name] = LayerSequenceBoundary(split_input=index == 0, gather_output=index == len(layers) - 1)
    return entries


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
