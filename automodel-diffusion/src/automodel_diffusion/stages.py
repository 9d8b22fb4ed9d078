"""Wan 2.2's two-expert pipelines: one stage (high- or low-noise transformer) fine-tuned at a time.

A Wan 2.2 A14B ``WanPipeline`` holds two transformers and a ``boundary_ratio`` in its config: while sampling, a
timestep ``t >= boundary_ratio * num_train_timesteps`` is denoised by ``transformer`` (the high-noise expert), a
lower one by ``transformer_2`` (the low-noise expert). ``model.stage`` picks the expert that trains; its flow-matching
sigmas are clamped into its own range (high_noise: [boundary, 1], low_noise: [0, boundary]), as upstream clamps them,
so it only learns the noise levels it denoises. The other expert stays frozen, off the device except while samples
are drawn, and is saved unchanged with the pipeline. Import-light: no torch at import.
"""

from __future__ import annotations

from typing import Any

from automodel.errors import AutomodelError, ConfigIssue

EXPERTS = {"high_noise": "transformer", "low_noise": "transformer_2"}
TWO_EXPERTS = "a two-transformer WanPipeline (Wan 2.2 A14B: transformer and transformer_2, with boundary_ratio)"


def has_two_experts(components: dict[str, Any]) -> bool:
    """Whether a pipeline's components (or a model_index.json's entries) hold a second transformer."""
    second = components.get("transformer_2")
    return bool(second[0]) if isinstance(second, list) else second is not None


def stage_issues(stage: Any, boundary_ratio: Any, index: dict[str, Any] | None, model: Any,
                 key: str = "model") -> list[ConfigIssue]:
    """What ``model.stage`` / ``model.boundary_ratio`` ask that cannot act; ``index``: the pipeline's
    model_index.json when it is a local directory (else the pipeline is checked once built)."""
    if stage is None and boundary_ratio is None:
        return [] if index is None or not has_two_experts(index) else [
            ConfigIssue(f"{key}.stage", f"required for {TWO_EXPERTS}: high_noise (trains transformer) or low_noise "
                                        "(trains transformer_2); one expert trains per run")]
    if stage is None:
        return [ConfigIssue(f"{key}.boundary_ratio", "applies with model.stage (high_noise or low_noise), which "
                                                     "picks the trained expert; set it or remove boundary_ratio")]
    issues = []
    if stage not in EXPERTS:
        issues.append(ConfigIssue(f"{key}.stage", f"'{stage}': expected high_noise (trains transformer) or "
                                                  "low_noise (trains transformer_2)"))
    if boundary_ratio is not None and (isinstance(boundary_ratio, bool) or not isinstance(boundary_ratio, (int, float))
                                       or not 0 < boundary_ratio < 1):
        issues.append(ConfigIssue(f"{key}.boundary_ratio", f"expected a number strictly between 0 and 1, found "
                                                           f"{boundary_ratio!r}"))
    if index is not None and not has_two_experts(index):
        issues.append(ConfigIssue(f"{key}.stage", f"applies to {TWO_EXPERTS}; this {index.get('_class_name')} has "
                                                  "one denoiser: remove stage and boundary_ratio"))
    elif index is not None and boundary_ratio is None and index.get("boundary_ratio") is None:
        issues.append(ConfigIssue(f"{key}.boundary_ratio", "required: the pipeline's model_index.json carries no "
                                                           "boundary_ratio"))
    for name in ("trainable_components", "pipeline_spec"):
        if model.get(name) is not None:
            issues.append(ConfigIssue(f"{key}.{name}", f"not with model.stage, which picks the trained transformer "
                                                       f"({', '.join(f'{s}: {e}' for s, e in EXPERTS.items())}) and "
                                                       f"loads the whole pipeline; remove {name}"))
    return issues


def sigma_range(stage: str, boundary_ratio: float) -> tuple[float, float]:
    """The stage's flow-matching sigmas: the high-noise expert's [boundary, 1], the low-noise one's [0, boundary]."""
    return (boundary_ratio, 1.0) if stage == "high_noise" else (0.0, boundary_ratio)


def check_pipeline(pipeline: Any, stage: str | None, boundary_ratio: float | None) -> float | None:
    """The boundary the stage trains at (None without a stage); a built pipeline that cannot take the stage (or
    needs one) is an error saying why."""
    two = has_two_experts(pipeline.components)
    if stage is None:
        if two:
            raise AutomodelError(f"model: this is {TWO_EXPERTS}; set model.stage: high_noise (trains transformer) or "
                                 "low_noise (trains transformer_2): one expert trains per run")
        if boundary_ratio is not None:
            raise AutomodelError("model.boundary_ratio: applies with model.stage; set it or remove boundary_ratio")
        return None
    if stage not in EXPERTS:
        raise AutomodelError(f"model.stage: '{stage}': expected high_noise or low_noise")
    if not two:
        raise AutomodelError(f"model.stage: applies to {TWO_EXPERTS}; this {type(pipeline).__name__} has one "
                             "denoiser: remove stage and boundary_ratio")
    boundary = boundary_ratio if boundary_ratio is not None else pipeline.config.get("boundary_ratio")
    if boundary is None:
        raise AutomodelError("model.boundary_ratio: required: the pipeline's config carries no boundary_ratio")
    if not 0 < float(boundary) < 1:
        raise AutomodelError(f"model.boundary_ratio: expected a number strictly between 0 and 1, found {boundary}")
    return float(boundary)
