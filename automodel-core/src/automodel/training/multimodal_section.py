"""``distributed.multimodal``: upstream's FSDP2 policy for a model's fully frozen multimodal modules (vision / audio
towers, projectors), checked here and applied by :mod:`automodel.training.parallel.multimodal_fsdp`.

``frozen_sharding`` chooses where FSDP2 puts a fully frozen module's parameters: ``root`` (the default) in the outer
unit, which every rank runs whatever its batch holds; ``per_layer`` one unit per block of the module, which needs
every rank to run (or skip) the module alike on each micro-batch; ``replicate`` outside FSDP2, a full copy on every
rank. ``vision.frame_sharding`` splits the vision encoder's frames over the context-parallel ranks; here every
context-parallel rank runs the whole vision encoder on the batch's images (the sequence is split after the merge):
only ``enabled: false`` is taken (it governs nothing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from automodel.errors import ConfigIssue

if TYPE_CHECKING:
    from automodel.config import Config

FROZEN_SHARDING = ("root", "per_layer", "replicate")
_KEYS = {"frozen_sharding", "vision"}
_FRAME_KEYS = {"enabled", "mesh_dims", "min_tokens", "min_frames", "min_local_patch_rows", "cost_alpha"}
_FRAME = "multimodal.vision.frame_sharding"


def multimodal_errors(value: Any) -> dict[str, str]:
    """Errors of a ``distributed.multimodal`` value (keyed below ``distributed``); normalises ``frozen_sharding``
    in place (any case, ``-`` for ``_``, as upstream reads it)."""
    if not isinstance(value, dict):
        return {"multimodal": f"{value!r}: must be a mapping {{frozen_sharding, vision: {{frame_sharding}}}}"}
    errors = _unknown("multimodal", value, _KEYS)
    if "frozen_sharding" in value:
        given = value["frozen_sharding"]
        normalised = given.lower().replace("-", "_") if isinstance(given, str) else given
        if normalised in FROZEN_SHARDING:
            value["frozen_sharding"] = normalised
        else:
            errors["multimodal.frozen_sharding"] = f"{given!r}: must be one of {', '.join(FROZEN_SHARDING)}"
    vision = value.get("vision") or {}
    if not isinstance(vision, dict):
        return {**errors, "multimodal.vision": f"{vision!r}: must be a mapping {{frame_sharding: {{...}}}}"}
    errors.update(_unknown("multimodal.vision", vision, {"frame_sharding"}))
    frames = vision.get("frame_sharding") or {}
    if not isinstance(frames, dict):
        return {**errors, _FRAME: f"{frames!r}: must be a mapping {{enabled, mesh_dims, min_tokens, ...}}"}
    errors.update(_unknown(_FRAME, frames, _FRAME_KEYS))
    if frames.get("enabled", False) is not False:
        errors[f"{_FRAME}.enabled"] = (
            f"{frames['enabled']!r}: frame sharding splits the vision encoder's frames over the context-parallel "
            "ranks, which is not implemented here: every rank runs the whole vision encoder on its batch's images "
            "(context parallelism splits the sequence after the images are merged into it); set enabled: false "
            "or remove the key")
    return errors


def _unknown(where: str, value: dict, known: set[str]) -> dict[str, str]:
    unknown = sorted(set(value) - known)
    if not unknown:
        return {}
    return {where: f"{', '.join(map(str, unknown))}: not a key of upstream's {where} settings (they are: "
                   f"{', '.join(sorted(known))})"}


def frozen_sharding(cfg: Config) -> str:
    """The ``distributed.multimodal.frozen_sharding`` of the run (``root`` unless given)."""
    settings = cfg.distributed
    value = settings.multimodal if settings is not None and isinstance(settings.multimodal, dict) else {}
    return value.get("frozen_sharding", "root")


def multimodal_issues(cfg: Config, module_names: tuple[str, ...]) -> list[ConfigIssue]:
    """Refusals of a ``distributed.multimodal`` section the run cannot act on: a recipe whose models have no
    multimodal modules (``module_names`` empty), or Megatron-FSDP, which shards the model its own way."""
    settings = cfg.distributed
    if settings is None or settings.multimodal is None:
        return []
    if not module_names:
        return [ConfigIssue("distributed.multimodal", "this recipe's models have no vision / audio towers or "
                                                      "projectors for these settings to place; remove the key")]
    if settings.strategy == "megatron_fsdp":
        return [ConfigIssue("distributed.multimodal", "its policies place frozen modules in FSDP2's units "
                                                      "(distributed.strategy: fsdp2); Megatron-FSDP shards the "
                                                      "model its own way: remove the key or use fsdp2")]
    return []


def multimodal_notes(cfg: Config, fsdp2: bool) -> list[str]:
    """Notes for ``distributed.multimodal`` settings that govern nothing this run."""
    settings = cfg.distributed
    value = settings.multimodal if settings is not None and isinstance(settings.multimodal, dict) else {}
    notes = []
    if "frozen_sharding" in value and not fsdp2:
        notes.append(f"note: distributed.multimodal.frozen_sharding: {value['frozen_sharding']} governs nothing "
                     "this run: it places frozen multimodal modules in FSDP2's units (distributed.strategy: fsdp2, "
                     "more than one process); here every rank holds the whole model")
    if "frame_sharding" in (value.get("vision") or {}):
        notes.append("note: distributed.multimodal.vision.frame_sharding governs nothing this run: it is off "
                     "(enabled: false), every rank runs the whole vision encoder on its own batch")
    return notes
