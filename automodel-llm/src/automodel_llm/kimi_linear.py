"""Upstream's ``KimiLinear48BConfig`` (``model.config`` of its Kimi-Linear-48B-A3B configs) as transformers' own
``KimiLinearConfig``, whose model (``KimiLinearForCausalLM``) trains here.

Upstream gives the 48B model a configuration class of its own only to tell it apart from Kimi K3's text backbone
(both checkpoints say ``model_type: kimi_linear``); transformers' class reads the 48B checkpoint's config.json as is.
Its ``kda_*`` keys choose upstream's Kimi-delta-attention kernels (flash-linear-attention's Triton kernels, CUDA
only). transformers' model runs the same attention in torch, always in its chunked form with the query and key
l2-normalised and the gate computed apart; the keys that ask for exactly that act (they are what runs), the CUDA
kernels are refused at validation with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from automodel.errors import AutomodelError

_CUDA = ("flash-linear-attention's Triton kernels need a CUDA GPU, which this machine lacks; transformers' Kimi "
         "Linear model here runs the attention in torch")
_FORMS = {  # key -> (the value that describes transformers' torch path, why another value cannot act)
    "kda_mode": ("chunk", "transformers' model trains with the chunked form (upstream's chunk), the recurrent "
                          "one is its one-token decoding step; set chunk or remove the key"),
    "kda_use_qk_l2norm_in_kernel": (True, "transformers' model always l2-normalises the query and key (upstream's "
                                          "true); a model without that normalisation is another model: remove it"),
    "kda_use_fused_gate": (False, f"true fuses the gate into the attention kernel: {_CUDA} (the gate computed "
                                  "apart, the same numbers: set false)"),
    "kda_unpad_inputs": (False, f"true removes the padding for the variable-length kernels: {_CUDA} (padded rows, "
                                "masked: set false)"),
}


def kimi_linear_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """Validation's check of the ``kda_*`` keys (see the module docstring)."""
    return {key: f"{kwargs[key]!r}: {why}" for key, (runs, why) in _FORMS.items()
            if key in kwargs and kwargs[key] != runs}


def _checked(kwargs: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    issues = kimi_linear_issues(kwargs)
    if issues:
        raise AutomodelError("; ".join(f"model.config.{key}: {message}" for key, message in issues.items()))
    for key in _FORMS:
        kwargs.pop(key, None)
    return kwargs.pop("name_or_path", None), kwargs


def kimi_linear_config(**kwargs: Any) -> Any:
    """``KimiLinear48BConfig(...)``: transformers' ``KimiLinearConfig`` of these settings."""
    from transformers import KimiLinearConfig

    name, settings = _checked(dict(kwargs))
    config = KimiLinearConfig(**settings)
    if name is not None:
        config.name_or_path = name
    return config


def kimi_linear_config_from_pretrained(pretrained_model_name_or_path: str, **kwargs: Any) -> Any:
    """``KimiLinear48BConfig.from_pretrained``: the checkpoint's config.json read by transformers'
    ``KimiLinearConfig`` (``kwargs`` override its keys); ``name_or_path`` names the model in the saved config."""
    from transformers import KimiLinearConfig

    name, settings = _checked(dict(kwargs))
    config = KimiLinearConfig.from_pretrained(pretrained_model_name_or_path, **settings)
    if name is not None:
        config.name_or_path = name
    return config


kimi_linear_config.automodel_config_issues = kimi_linear_issues  # type: ignore[attr-defined]
kimi_linear_config_from_pretrained.automodel_config_issues = kimi_linear_issues  # type: ignore[attr-defined]
