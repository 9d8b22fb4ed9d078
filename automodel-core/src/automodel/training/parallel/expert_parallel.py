"""Expert parallelism (``distributed.ep_size``) of a Hugging Face mixture-of-experts model over the data-parallel
ranks, as upstream lays it out: the ``ep_size`` consecutive data-parallel ranks of an *ep group* split the experts of
every MoE layer (rank ``i`` keeps experts ``i * E / ep ..``), the groups replicate each other, and FSDP2 shards every
other parameter over the data-parallel ranks as usual. Under pipeline parallelism each stage's data-parallel ranks
do this for the MoE layers of that stage; under context parallelism the ep groups are formed over the data- and
context-parallel ranks together (FSDP2 shards and averages over both; experts take tokens wherever they come from).

Which experts modules: transformers' fused experts (``@use_experts_implementation``): ``gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]``, the layout of Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 and most MoE models of
transformers 5; its non-gated form (``has_gate=False``: ``up_proj`` ``[E, I, H]`` and ``down_proj``, the activation
alone between them: Nemotron-H); with biases (``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj_bias``), transposed
weights (``[E, H, 2I]``, ``[E, I, H]``) and gate and up interleaved (the module's own ``_apply_gate``): GPT-OSS's; with
a norm after each expert where the module has one. Each expert computes as transformers' own experts implementations
do. LoRA on the experts' fused weights is taken for the untransposed layouts; other experts modules are refused by
name (:func:`experts_issues`).

:func:`apply_expert_parallel` turns both parameters into ``DTensor``\\ s on the 2-D mesh ``(ep_replicate, ep)`` with
placements ``(Replicate(), Shard(0))`` (the expert dimension sharded), so materialisation, DCP checkpoints and the
HF export read and consolidate them like any sharded parameter, and FSDP2 leaves them alone (ignored parameters).
Its forward: the group's ranks gather each other's tokens with their top-k routing (padded to the longest rank),
each computes its own experts' contributions to all of them, and a reduce-scatter returns each rank the sum for its
own tokens; the collectives are differentiable (``all_gather_single_autograd`` / ``reduce_scatter_single_autograd``),
so the router and the layers below get their gradients through them.

LoRA on the experts (peft's ``ParamWrapper`` around the fused parameters, as ``all-linear`` LoRA does): the
forward adds to each local expert's slice its own low-rank update from the stacked factors, which FSDP2 shards
over the data-parallel ranks like every other adapter; a rank's gradient is nonzero only in its experts' slices,
and FSDP2's sum over the ranks divided by the data-parallel size is one process's gradient, as for the experts.

Gradients: a local expert's gradient arrives summed over the ep group's tokens (the all-gather's backward); it is
summed over the replicas of the group too and divided by the ranks FSDP2 averages over (data-parallel x
context-parallel), which equals FSDP2's average of every other parameter (the loop scales each rank's loss by
``dp * cp / tokens``), so N ranks train like one process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.errors import ConfigIssue
from automodel.fused_experts import expert_count, expert_parameter_names, experts_modules, is_gated

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

EP_MESH_DIMS = ("ep_replicate", "ep")
# a Hugging Face config's number of routed experts, under the names MoE architectures use
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def config_expert_count(hf_config: Any) -> int | None:
    """The number of routed experts a Hugging Face config declares (None: not a MoE config we can read)."""
    for key in _EXPERT_COUNT_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def config_declares_no_experts(hf_config: Any) -> bool:
    """Whether a Hugging Face config says its model has no routed experts: it has an expert-count key, unset or 0
    (Gemma 4's dense variants: ``num_experts: null``), where a config without such a key says nothing."""
    declared = [getattr(hf_config, key) for key in _EXPERT_COUNT_KEYS if hasattr(hf_config, key)]
    return bool(declared) and config_expert_count(hf_config) is None


def _layout_problems(module: nn.Module) -> list[str]:
    names = set(module._parameters)
    problems = []
    if names != set(expert_parameter_names(module)):
        problems.append(f"parameters {sorted(names)}")
    if not hasattr(module, "_apply_gate" if is_gated(module) else "act_fn") or not hasattr(module, "num_experts"):
        problems.append(f"no {'_apply_gate' if is_gated(module) else 'act_fn'} / num_experts")
    if getattr(module, "has_post_expert_norm", False) and not hasattr(module, "post_expert_norm"):
        problems.append("no post_expert_norm")
    return problems


def experts_issues(model: nn.Module, ep_size: int, key: str = "distributed.ep_size") -> list[ConfigIssue]:
    """Why ``model``'s experts cannot be split over ``ep_size`` ranks (empty when they can)."""
    found = experts_modules(model)
    if not found:
        return [ConfigIssue(key, f"{ep_size}: expert parallelism splits the experts of a mixture-of-experts model, "
                            f"and {type(model).__name__} has no experts module with fused gate_up_proj (or up_proj) "
                            "/ down_proj parameters (transformers' MoE layout); use ep_size: 1 (or null)")]
    issues = []
    for name, _ in found:
        if any(not hasattr(wrapper, "parameter_name") for wrapper in _lora_wrappers(model, name).values()):
            return [ConfigIssue("peft.target_modules", f"an adapter wraps the experts module '{name}' in a way "
                                "expert parallelism does not handle (only peft's LoRA on their fused parameters); "
                                "name the modules to adapt outside the experts or use ep_size: 1")]
        if _lora_wrappers(model, name) and getattr(model.get_submodule(name), "is_transposed", False):
            return [ConfigIssue("peft.target_modules", f"LoRA on the experts module '{name}', whose weights are "
                                "stored transposed (GPT-OSS's layout), is not handled under expert parallelism; "
                                "adapt the modules outside the experts or use ep_size: 1")]
    kinds = {}
    for name, module in found:
        kinds.setdefault(type(module).__name__, (name, module))
    for kind, (name, module) in kinds.items():
        problems = _layout_problems(module)
        if problems:
            issues.append(ConfigIssue(key, f"{ep_size}: the experts module {kind} ('{name}') has a layout expert "
                                      f"parallelism does not handle here ({', '.join(problems)}; supported: "
                                      "transformers' fused experts, gate_up_proj (or up_proj without a gate) and "
                                      "down_proj, with their biases where the module has them, as in Qwen3-MoE, "
                                      "Mixtral, OLMoE, Nemotron-H, GPT-OSS); use ep_size: 1 (or null)"))
            continue
        experts = expert_count(module)
        if experts % ep_size:
            issues.append(ConfigIssue(key, f"{ep_size} does not divide the number of experts ({experts}, {kind} "
                                      f"'{name}'); use an ep_size that divides {experts}"))
    return issues


def expert_count_issues(experts: int, ep_size: int, key: str = "distributed.ep_size") -> list[ConfigIssue]:
    """``ep_size`` against the number of experts a config declares (where the model cannot be built to check)."""
    if experts % ep_size:
        return [ConfigIssue(key, f"{ep_size} does not divide the model's number of experts ({experts}); use an "
                            f"ep_size that divides {experts}")]
    return []


def build_expert_mesh(world_size: int, ep_size: int, device_type: str, pp_size: int = 1) -> DeviceMesh:
    """The 2-D mesh ``(ep_replicate, ep)`` of this rank's pipeline stage: the data-parallel ranks of one stage are
    consecutive (``pp`` is the device mesh's slowest dimension) and consecutive ranks among them form an ep group, so
    an ep group and its replicas never span two stages (every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    per_stage = world_size // pp_size
    mesh = init_device_mesh(device_type, (pp_size, per_stage // ep_size, ep_size),
                            mesh_dim_names=("ep_pp", *EP_MESH_DIMS))
    return mesh[EP_MESH_DIMS]


@dataclass(frozen=True)
class ExpertShard:
    """One rank's part of an experts module: its group, its experts ``first .. first + count``, and the gradient
    factor and replica group that make its gradients those of one process."""

    group: Any
    first: int
    count: int
    num_experts: int
    grad_scale: float
    replicas: Any  # the process group of the ranks holding the same experts (None when there is one ep group)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, dp_size: int) -> list[str]:
    """Shard every experts module of ``model`` (on the meta device or materialised) over ``mesh``'s ``ep``
    dimension and replace its forward; ``dp_size``: the ranks FSDP2 averages gradients over. Returns the names of
    the modules sharded (validated first by :func:`experts_issues`)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    size, rank = mesh["ep"].size(), mesh["ep"].get_local_rank()
    replicas = mesh["ep_replicate"].get_group() if mesh["ep_replicate"].size() > 1 else None
    names = []
    for name, module in experts_modules(model):
        experts = expert_count(module)
        count = experts // size
        for attr in expert_parameter_names(module):
            param = module._parameters[attr]
            sharded = distribute_tensor(param.data, mesh, [Replicate(), Shard(0)], src_data_rank=None)
            module._parameters[attr] = nn.Parameter(sharded, requires_grad=param.requires_grad)
        shard = ExpertShard(mesh["ep"].get_group(), rank * count, count, experts, 1.0 / dp_size, replicas)
        wrappers = _lora_wrappers(model, name)
        module.forward = functools.partial(_forward, module, shard, wrappers)
        for wrapper in wrappers.values():  # its own forward would add the whole experts' update to the local slice
            wrapper.forward = wrapper.base_layer.__call__
        names.append(name)
    return names


def _lora_wrappers(model: nn.Module, name: str) -> dict[str, nn.Module]:
    """The LoRA wrappers around the experts module ``name`` (peft's ``ParamWrapper``, one per adapted parameter,
    nested through ``base_layer``), by the parameter each adapts."""
    wrappers = {}
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
        wrapper = model.get_submodule(name)
        wrappers[getattr(wrapper, "parameter_name", type(wrapper).__name__)] = wrapper
    return wrappers


def _local_lora_delta(wrapper: nn.Module, shard: ExpertShard) -> torch.Tensor | None:
    """The LoRA update of this rank's experts of the parameter ``wrapper`` adapts, ``[count, out, in]`` like the
    local slice of that parameter (None: no active adapter). peft's ``ParamWrapper`` stacks the experts' factors:
    ``lora_A`` ``(r*E, in)`` expert-major, ``lora_B`` ``(out, r*E)`` expert-minor; the factors stay whole (FSDP2
    shards them over the data-parallel ranks like any adapter) and only the local experts' slices are used, so
    each slice's gradient comes from the rank holding its expert and FSDP2's reduction over the ranks sums them."""
    if wrapper.disable_adapters:
        return None
    delta = None
    first, last = shard.first, shard.first + shard.count
    for adapter in wrapper.active_adapters:
        if adapter not in wrapper.lora_A:
            continue
        lora_a, lora_b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
        lora_a = lora_a.reshape(shard.num_experts, -1, lora_a.shape[-1])[first:last]
        lora_b = lora_b.reshape(lora_b.shape[0], -1, shard.num_experts)[..., first:last]
        # the layout handled here, [E, out, in] (not transposed), is the one peft reads as in/out swapped
        part = torch.einsum("ore,eri->eoi", lora_b, lora_a) * wrapper.scaling[adapter]
        delta = part if delta is None else delta + part
    return delta


def _expert_weight(module: nn.Module, shard: ExpertShard, wrappers: dict[str, nn.Module], attr: str
                   ) -> torch.Tensor:
    """This rank's experts' slice of ``module``'s parameter ``attr``, with the gradient of one process and its
    LoRA update (when an adapter wraps it)."""
    weight = _ExpertGradient.apply(module._parameters[attr].to_local(), shard.grad_scale, shard.replicas)
    delta = _local_lora_delta(wrappers[attr], shard) if attr in wrappers else None
    return weight if delta is None else weight + delta.to(weight.dtype)


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters :func:`apply_expert_parallel` sharded (FSDP2 must leave them alone)."""
    from torch.distributed.tensor import DTensor

    return {module._parameters[attr] for _, module in experts_modules(model) for attr in expert_parameter_names(module)
            if isinstance(module._parameters[attr], DTensor)}


def _project(module: nn.Module, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             expert: int) -> torch.Tensor:
    """One local expert's projection of ``inputs``, its weight stored ``[out, in]`` or transposed ``[in, out]``."""
    out = inputs @ weight if getattr(module, "is_transposed", False) else nn.functional.linear(inputs, weight)
    return out if bias is None else out + bias[expert]


class _ExpertGradient(torch.autograd.Function):
    """Identity forward; backward turns the ep group's summed gradient of the local experts into one process's."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, scale: float, replicas: Any) -> torch.Tensor:
        ctx.scale, ctx.replicas = scale, replicas
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad * ctx.scale
        if ctx.replicas is not None:
            dist.all_reduce(grad, group=ctx.replicas)
        return grad, None, None


def _forward(module: nn.Module, shard: ExpertShard, wrappers: dict[str, nn.Module], hidden_states: torch.Tensor,
             top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward over the ep group (see the module docstring), with the LoRA update of the
    local experts where ``wrappers`` adapt its parameters (their own forwards then only call through)."""
    from torch.distributed._functional_collectives import (
        all_gather_single,
        all_gather_single_autograd,
        reduce_scatter_single_autograd,
    )

    tokens = hidden_states.shape[0]
    longest = torch.tensor([tokens], device=hidden_states.device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=shard.group)
    pad = int(longest.item()) - tokens
    hidden = nn.functional.pad(hidden_states, (0, 0, 0, pad))
    index = nn.functional.pad(top_k_index, (0, 0, 0, pad), value=shard.num_experts)  # padding: no expert
    weights = nn.functional.pad(top_k_weights, (0, 0, 0, pad))
    hidden = all_gather_single_autograd(hidden, 0, shard.group)
    weights = all_gather_single_autograd(weights, 0, shard.group)
    index = torch.as_tensor(all_gather_single(index, 0, shard.group))
    local = [_expert_weight(module, shard, wrappers, name).to(hidden.dtype) for name in expert_parameter_names(module)]
    up, down, *biases = local
    up_bias, down_bias = biases if biases else (None, None)
    activate = module._apply_gate if is_gated(module) else module.act_fn
    out = torch.zeros_like(hidden)
    used = False
    for expert in range(shard.count):
        token, slot = torch.where(index == shard.first + expert)
        if token.numel() == 0:
            continue
        used = True
        part = activate(_project(module, hidden[token], up[expert], up_bias, expert))
        part = _project(module, part, down[expert], down_bias, expert)
        if getattr(module, "has_post_expert_norm", False):
            part = module.post_expert_norm(part)
        out = out.index_add(0, token, (part * weights[token, slot, None]).to(out.dtype))
    if not used:
        # no token chose these experts: their gradient is zero (as in one process), not missing, and the backward
        # still runs the reduce-scatters of the gathered tokens and weights that the group's other ranks run (a
        # rank skipping them would leave the others waiting: torch's pipeline stages, for one, first run a
        # backward on uninitialised activations, whose routing is arbitrary)
        out = out + 0.0 * (sum(tensor.sum() for tensor in local) + hidden.sum() + weights.sum())
    mine = reduce_scatter_single_autograd(out, "sum", 0, shard.group)
    return mine[:tokens]
