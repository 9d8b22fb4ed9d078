"""Validation of the MTP heads (``model.num_nextn_predict_layers`` > 0) against the rest of a run's config: what
they are not wired into is refused with the reason (no torch import)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from automodel.errors import ConfigIssue
from automodel.model_kwargs import (
    MTP,
    MTP_CONFIG_MAPPINGS,
    MTP_DEPTH_KEYS,
    MTP_FAMILIES,
    MTP_KEYS,
    mtp_config_depths,
    mtp_depths_in_config,
    mtp_depths_zero,
)

_SPLITS = {"tp_size": "tensor parallelism (the heads' layers have no tensor-parallel plan)",
           "cp_size": "context parallelism (each rank's part of a row would shift in tokens of another part)"}


def mtp_asked(cfg: Any) -> str | None:
    """The model key that asks for heads (None: none does): ``num_nextn_predict_layers`` > 0, or, unset, a scaling
    factor or ``mtp_use_repeated_layer`` (upstream's Super-V3 form: the checkpoint config's count), or a count > 0
    in the section's own config mapping (:func:`mtp_depths_in_config`); none where the section sets a depths count 0
    (:func:`mtp_depths_zero`, see :func:`mtp_off_notes`)."""
    model = cfg.model
    if model is None or mtp_depths_zero(model):
        return None
    for key in MTP_KEYS:
        if model.get(key) not in (None, False):
            return f"model.{key}"
    in_config = mtp_depths_in_config(model)
    return None if in_config is None else f"model.{in_config}"


def _configured_depths(model: Any, hf_config: Any) -> int:
    """The depths the checkpoint's config holds, the model section's ``text_config`` keys applied."""
    text = hf_config.get_text_config()
    overrides = model.get("text_config") if isinstance(model.get("text_config"), Mapping) else {}
    keys = [key for key in MTP_DEPTH_KEYS if key in overrides]
    if keys:
        return int(overrides[keys[0]] or 0)
    return mtp_config_depths(text, MTP_FAMILIES[hf_config.model_type][2])


def mtp_issues(cfg: Any, hf_config: Any, supported: bool = True) -> list[ConfigIssue]:
    """Why the heads cannot train in this run (empty: they can). ``hf_config``: the model's config where it can be
    read before building (None: the family is checked when the model is built); ``supported``: whether the
    recipe's loss adds the heads'. Every family's heads run on pipeline stages (:mod:`automodel.mtp.pipeline`)."""
    key = mtp_asked(cfg)
    if key is None:
        return []
    counts = key.endswith(MTP_DEPTH_KEYS)  # a depths count, at the section's top or in its config mapping
    value = _value_at(cfg.model, key.removeprefix("model."))
    asks = f"{value} asks for {MTP}" if counts else f"acts on {MTP}"
    model_type = getattr(hf_config, "model_type", None)
    if hf_config is not None and model_type not in MTP_FAMILIES and key.startswith(MTP_CONFIG_MAPPINGS):
        return []  # a count in the config of a family without heads builds none: the run's note says so
    if not supported:
        return [ConfigIssue(key, f"{asks}, whose loss this recipe does not add; use the fine-tuning recipe")]
    if hf_config is not None and model_type not in MTP_FAMILIES:
        return [ConfigIssue(key, f"{asks}; this model is {model_type}: remove the MTP keys")]
    if hf_config is not None and not counts and not _configured_depths(cfg.model, hf_config):
        depths_key = MTP_FAMILIES[model_type][2]
        return [ConfigIssue(key, f"{asks}, but the checkpoint's config has {depths_key} 0 (no heads); set "
                            "model.num_nextn_predict_layers to the number of tokens ahead")]
    issues = []
    settings = cfg.get("distributed")
    for name, why in _SPLITS.items():
        size = getattr(settings, name, 1) if settings is not None else 1
        if isinstance(size, int) and size > 1:
            issues.append(ConfigIssue(key, f"{asks}, which are not wired into {why}, but distributed.{name} is "
                                      f"{size}; use {name} 1 or remove the MTP keys"))
    return issues


def _value_at(model: Mapping[str, Any], dotted: str) -> Any:
    """The value of ``dotted`` (``config.num_nextn_predict_layers``) in the model section."""
    return functools.reduce(Mapping.get, dotted.split("."), model)


def no_heads_note(cfg: Any, model_type: str) -> str | None:
    """The run-start note for a depths count > 0 in the model section's config mapping of a family without heads
    here (upstream's GLM-4.7-Flash benchmark keeps its checkpoint's count): the model builds none (None: no such
    count)."""
    key = mtp_depths_in_config(cfg.model) if cfg.model is not None else None
    if key is None or model_type in MTP_FAMILIES:
        return None
    value = _value_at(cfg.model, key)
    return (f"note: model.{key}: {value} builds no heads: {MTP}, and this model is {model_type}, whose transformers "
            "model (and upstream's) has none; the count stays in the saved config")


def mtp_off_notes(cfg: Any) -> list[str]:
    """The run-start note that the scaling factor / repeated-layer key weighs no heads: the model section sets a
    depths count 0 (upstream's DeepSeek-V4 and Step 3 examples keep the factor for when the count is raised)."""
    model = cfg.model
    if model is None or not mtp_depths_zero(model):
        return []
    return [f"note: model.{key}: {model.get(key)} governs nothing this run: the model section sets the MTP depths to 0 "
            "(no heads)" for key in MTP_KEYS[1:] if model.get(key) not in (None, False)]
