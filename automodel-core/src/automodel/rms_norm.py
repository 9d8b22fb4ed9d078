"""Upstream's ``model.backend.rms_norm: torch``: RMSNorm as ``torch.nn.RMSNorm`` computes it, in the input's dtype
(bf16 weights: a bf16 norm), where a Hugging Face RMSNorm upcasts to float32 (upstream's ``torch_fp32``).

RMSNorm modules of the standard form ``weight * x / sqrt(mean(x^2) + eps)`` and of the offset form
``(1 + weight) * x / sqrt(mean(x^2) + eps)`` (Gemma's, Qwen3.5's; ``torch.nn.RMSNorm`` with ``1 + weight`` as its
weight) change; each module class is checked on a probe first, and a class of any other form stops the build with
the reason rather than being computed wrongly.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from automodel.errors import AutomodelError

_EPS_NAMES = ("variance_epsilon", "eps")


def _eps(module: torch.nn.Module) -> float | None:
    return next((float(getattr(module, n)) for n in _EPS_NAMES if isinstance(getattr(module, n, None), float)), None)


def _forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    offset = self._input_dtype_offset  # 1.0 for the (1 + weight) form; no addition per call for the usual one
    weight = (self.weight + offset if offset else self.weight).to(hidden_states.dtype)
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), weight, self._input_dtype_eps)


def _form(cls: type, size: int, eps: float) -> float | None:
    """The offset of ``cls``'s weight: 0.0 when it computes ``weight * x / sqrt(mean(x^2) + eps)``, 1.0 for
    ``(1 + weight) * ...``, None for any other form (checked on a float32 probe on the CPU, also while the model
    itself is built on the meta device)."""
    with torch.device("cpu"):
        return _probe(cls, size, eps)


def _probe(cls: type, size: int, eps: float) -> float | None:
    try:
        probe = cls(size, eps=eps)
    except TypeError:
        return None
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(size, generator=generator))
        x = torch.randn(3, size, generator=generator)
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        got = probe(x)
        return next((offset for offset in (0.0, 1.0)
                     if torch.allclose(got, (probe.weight + offset) * normed, rtol=1e-5, atol=1e-6)), None)


def use_input_dtype_rms_norm(model: torch.nn.Module) -> int:
    """Every RMSNorm module of ``model`` computes in its input's dtype (``torch.nn.RMSNorm``'s arithmetic); how many.
    An ``AutomodelError`` when the model has an RMSNorm of another form, or none."""
    checked: dict[type, float | None] = {}
    count = 0
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("RMSNorm"):
            continue
        weight, eps = getattr(module, "weight", None), _eps(module)
        cls = type(module)
        if cls not in checked:
            checked[cls] = _form(cls, weight.shape[0], eps) if weight is not None and weight.dim() == 1 and \
                eps is not None else None
        if checked[cls] is None:
            raise AutomodelError(f"model.backend.rms_norm: 'torch' computes weight * x / sqrt(mean(x^2) + eps) (or "
                                 f"(1 + weight) * ...) in the input's dtype; {name} ({cls.__name__}) is an RMSNorm of "
                                 "another form, which this setting would change: use torch_fp32 (the model's own "
                                 "RMSNorm)")
        module._input_dtype_eps, module._input_dtype_offset = eps, checked[cls]
        module.forward = types.MethodType(_forward, module)
        count += 1
    if not count:
        raise AutomodelError("model.backend.rms_norm: 'torch' selects the RMSNorm arithmetic, but this model has no "
                             "RMSNorm module: remove the setting")
    return count
