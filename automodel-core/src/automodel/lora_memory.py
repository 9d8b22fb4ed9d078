"""Upstream's ``peft.use_memory_efficient_lora``: the LoRA branch ``scale * B(A(x))`` as one autograd function that
keeps only its input and the two adapter weights, and recomputes the rank-r activation ``A(x)`` in backward (less
activation memory per adapted layer: tokens x rank values; the same gradients)."""

from __future__ import annotations

import types
from typing import Any

import torch


class LowRankBranch(torch.autograd.Function):
    """``scale * (x @ A.T) @ B.T``, saving ``x``, ``A`` and ``B`` only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x, a, b)
        ctx.scale = scale
        return (x @ a.t()) @ b.t() * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, a, b = ctx.saved_tensors
        grad = grad * ctx.scale
        hidden = x @ a.t()  # recomputed, not kept from forward
        grad_hidden = grad @ b
        flat = x.shape[-1], grad.shape[-1], hidden.shape[-1]
        grad_b = grad.reshape(-1, flat[1]).t() @ hidden.reshape(-1, flat[2]) if ctx.needs_input_grad[2] else None
        grad_a = grad_hidden.reshape(-1, flat[2]).t() @ x.reshape(-1, flat[0]) if ctx.needs_input_grad[1] else None
        grad_x = grad_hidden @ a if ctx.needs_input_grad[0] else None
        return grad_x, grad_a, grad_b, None


def _forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's ``lora.Linear.forward`` for one active, unmerged plain-LoRA adapter, with the branch recomputed; peft's
    own forward for everything else (merged or disabled adapters, several adapters, DoRA, extra arguments)."""
    active = self.active_adapters
    name = active[0] if len(active) == 1 else None
    if args or kwargs or self.disable_adapters or self.merged or name not in self.lora_A or \
            self.use_dora.get(name, False):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    dropped = self.lora_dropout[name](x).to(lora_a.weight.dtype)
    branch = LowRankBranch.apply(dropped, lora_a.weight, lora_b.weight, self.scaling[name])
    return result + branch.to(result.dtype)


def recompute_lora_branches(model: torch.nn.Module) -> int:
    """Give every peft LoRA linear layer of ``model`` the recomputing forward; how many there are."""
    from peft.tuners.lora.layer import Linear

    layers = [module for module in model.modules() if isinstance(module, Linear)]
    for module in layers:
        module.forward = types.MethodType(_forward, module)
    return len(layers)
