"""Validation of the MTP heads (``model.num_nextn_predict_layers`` > 0) against the rest of a run's config: what
they are not wired into is refused with the reason (no torch import)."""

from __future__ import annotations

from typing import Any

from automodel.errors import ConfigIssue
from automodel.model_kwargs import MTP, MTP_FAMILIES

KEY = "model.num_nextn_predict_layers"
_SPLITS = {"pp_size": "pipeline parallelism (the heads would run on the last stage, without the token embeddings)",
           "tp_size": "tensor parallelism (the heads' layers have no tensor-parallel plan)",
           "cp_size": "context parallelism (each rank's part of a row would shift in tokens of another part)",
           "ep_size": "expert parallelism (the heads' experts are not split over the ranks)"}


def mtp_depths(cfg: Any) -> int:
    """The heads the model section asks for (0: none)."""
    model = cfg.model
    depths = model.get("num_nextn_predict_layers") if model is not None else None
    return depths if isinstance(depths, int) and not isinstance(depths, bool) else 0


def mtp_issues(cfg: Any, hf_config: Any, supported: bool = True) -> list[ConfigIssue]:
    """Why the heads cannot train in this run (empty: they can). ``hf_config``: the model's config where it can be
    read before building (None: the family is checked when the model is built); ``supported``: whether the
    recipe's loss adds the heads'."""
    depths = mtp_depths(cfg)
    if depths <= 0:
        return []
    asks = f"{depths} asks for {MTP}"
    if not supported:
        return [ConfigIssue(KEY, f"{asks}, whose loss this recipe does not add; use the fine-tuning recipe or 0")]
    issues = []
    model_type = getattr(hf_config, "model_type", None)
    if hf_config is not None and model_type not in MTP_FAMILIES:
        issues.append(ConfigIssue(KEY, f"{asks}; this model is {model_type}: remove it or use 0"))
    settings = cfg.get("distributed")
    for name, why in _SPLITS.items():
        size = getattr(settings, name, 1) if settings is not None else 1
        if isinstance(size, int) and size > 1:
            issues.append(ConfigIssue(KEY, f"{asks}, which are not wired into {why}, but distributed.{name} is "
                                      f"{size}; use {name} 1 or num_nextn_predict_layers 0"))
    packing = cfg.get("packed_sequence")
    if (getattr(packing, "packed_sequence_size", 0) or 0) > 0:
        issues.append(ConfigIssue(KEY, f"{asks}: their tokens ahead would cross from one packed sample into the "
                                  "next (the heads keep no sample boundaries); remove packed_sequence or use 0"))
    return issues
