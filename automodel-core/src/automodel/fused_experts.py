"""transformers' fused experts modules (``@use_experts_implementation``): the 3-D parameters ``[E, out, in]`` (or
transposed) that hold every expert of a mixture-of-experts layer, named by the module's layout. Read by expert
parallelism, LoRA's expert targets, the balanced routing of ``model.backend.fake_balanced_gate`` and the experts'
load metrics (``moe_metrics``)."""

from __future__ import annotations

from typing import Any

GATED_WEIGHTS = ("gate_up_proj", "down_proj")  # gate and up fused in one: Qwen3-MoE, Mixtral, GPT-OSS, ...
UNGATED_WEIGHTS = ("up_proj", "down_proj")  # has_gate=False, the activation alone between them: Nemotron-H
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")  # any layout's fused weights
_BIAS = "_bias"  # has_bias: each weight's bias is the parameter of its name + "_bias"


def is_gated(module: Any) -> bool:
    return getattr(module, "has_gate", True) is not False


def expert_parameter_names(module: Any) -> tuple[str, ...]:
    """The names of an experts module's fused parameters: its first projection's and ``down_proj``, then their
    biases where it has them."""
    weights = GATED_WEIGHTS if is_gated(module) else UNGATED_WEIGHTS
    return (*weights, *(name + _BIAS for name in weights)) if getattr(module, "has_bias", False) else weights


def is_fused_experts(module: Any) -> bool:
    """Whether ``module`` holds its experts as fused 3-D parameters (of any layout)."""
    param = getattr(module, "_parameters", {}).get(expert_parameter_names(module)[0])
    return param is not None and param.dim() == 3


def experts_modules(model: Any) -> list[tuple[str, Any]]:
    """Every module of ``model`` holding fused 3-D expert parameters, with its name."""
    return [(name, module) for name, module in model.named_modules() if is_fused_experts(module)]


def expert_count(module: Any) -> int:
    """The number of experts a fused experts module holds (all of them, also when they are sharded)."""
    return module._parameters[expert_parameter_names(module)[0]].shape[0]
