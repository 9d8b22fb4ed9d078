"""Upstream's ``model.backend.gate_precision``: every router of a Hugging Face mixture-of-experts model computes its
logits in that dtype (upstream's own MoE ``Gate`` does the same: its input and weight cast to the dtype).

A router is a module with a 2-D ``weight`` of ``num_experts`` rows and ``num_experts`` / ``top_k`` attributes
(transformers' ``*TopKRouter`` / ``*Router`` modules: Qwen3-MoE's and OLMoE's ``mlp.gate``, Mixtral's, GPT-OSS's
``mlp.router`` ...). Its class becomes a subclass whose forward casts its floating inputs and parameters to the dtype
and runs outside ``torch.autocast`` (which would otherwise run the matmul in the autocast dtype); the stored
parameters keep their dtype, so checkpoints do not change. Under FSDP2 each router is its own unit whose policy
gathers, reduces and outputs in the dtype (``automodel.training.parallel.fsdp.apply_fsdp2``), so mixed precision
never casts its weight down first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from automodel.errors import AutomodelError, ConfigIssue


def is_router(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a mixture-of-experts router: a ``[num_experts, hidden]`` weight that picks ``top_k``."""
    weight = module._parameters.get("weight")
    experts = getattr(module, "num_experts", None)
    return (weight is not None and weight.dim() == 2 and isinstance(experts, int) and weight.shape[0] == experts
            and isinstance(getattr(module, "top_k", None), int))


class _RouterInPrecision:
    """Mixed into a router's class: the forward in ``gate_dtype`` (inputs and parameters cast, autocast off)."""

    gate_dtype: torch.dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_cast(a, self.gate_dtype) for a in args)
        kwargs = {k: _cast(v, self.gate_dtype) for k, v in kwargs.items()}
        device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False), _parameters_in(self, self.gate_dtype):
            return super().forward(*args, **kwargs)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


@contextlib.contextmanager
def _parameters_in(module: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """The module's own floating parameters cast to ``dtype`` for the forward (gradients reach the stored ones
    through the cast); nothing changes where they already are in it (FSDP2's unit gathers them in it)."""
    stored = {name: p for name, p in module._parameters.items()
              if p is not None and p.is_floating_point() and p.dtype != dtype}
    for name, param in stored.items():
        module._parameters[name] = param.to(dtype)
    try:
        yield
    finally:
        module._parameters.update(stored)


def _no_router(model: torch.nn.Module) -> str:
    return (f"sets the dtype of a mixture-of-experts model's router, and {type(model).__name__} has no router (a "
            "module with a [num_experts, hidden] weight and top_k): remove the setting")


def router_issues(hf_config: Any) -> list[ConfigIssue]:
    """Validation's check of ``model.backend.gate_precision`` against the causal LM ``hf_config`` describes, built
    on the meta device (no memory); none where transformers cannot build it here (the built model is checked)."""
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception:  # not a causal LM transformers builds from its config alone
        return []
    if any(is_router(m) for m in model.modules()):
        return []
    return [ConfigIssue("model.backend.gate_precision", _no_router(model))]


def use_gate_precision(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Every router of ``model`` computes in ``dtype``; how many. An ``AutomodelError`` when it has none."""
    routers = [m for m in model.modules() if is_router(m)]
    if not routers:
        raise AutomodelError(f"model.backend.gate_precision: {_no_router(model)}")
    for module in routers:
        cls = type(module)
        if not isinstance(module, _RouterInPrecision):
            module.__class__ = type(cls.__name__, (_RouterInPrecision, cls), {"__module__": cls.__module__})
        module.gate_dtype = dtype
    return len(routers)


def routers_in_precision(model: torch.nn.Module) -> dict[torch.nn.Module, torch.dtype]:
    """The routers :func:`use_gate_precision` set, each with its dtype (for FSDP2's units)."""
    return {m: m.gate_dtype for m in model.modules() if isinstance(m, _RouterInPrecision)}
