"""``distributed.multimodal``: upstream's FSDP2 policy for a model's fully frozen multimodal modules (vision / audio
towers, projectors), checked here and applied by :mod:`automodel.training.parallel.multimodal_fsdp`.

``frozen_sharding`` chooses where FSDP2 puts a fully frozen module's parameters: ``root`` (the default) in the outer
unit, which every rank runs whatever its batch holds; ``per_layer`` one unit per block of the module, which needs
every rank to run (or skip) the module alike on each micro-batch; ``replicate`` outside FSDP2, a full copy on every
rank. ``vision.frame_sharding`` (``enabled: true`` with ``cp_size > 1``) splits the vision encoder's images / video
frames over the context-parallel ranks (``automodel_vlm.frame_sharding``); checked here, with its thresholds
(``min_tokens``, ``min_frames``), its padding floor (``min_local_patch_rows``) and its balance (``cost_alpha``).
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
    errors.update(_frame_value_errors(frames))
    return errors


def _frame_value_errors(frames: dict) -> dict[str, str]:
    """Errors of ``frame_sharding``'s values (upstream's types; each key acts, see automodel_vlm.frame_sharding)."""
    errors = {}
    if not isinstance(frames.get("enabled", False), bool):
        errors[f"{_FRAME}.enabled"] = f"{frames['enabled']!r}: must be true or false"
    mesh = frames.get("mesh_dims", ["cp"])
    if not isinstance(mesh, (list, tuple)) or list(mesh) != ["cp"]:
        errors[f"{_FRAME}.mesh_dims"] = (f"{frames['mesh_dims']!r}: frames are split over the context-parallel "
                                         "ranks only (as upstream); use [cp] or remove the key")
    for key in ("min_tokens", "min_frames", "min_local_patch_rows"):
        if key in frames and not _count(frames[key]):
            errors[f"{_FRAME}.{key}"] = f"{frames[key]!r}: must be a whole number >= 0"
    alpha = frames.get("cost_alpha", "auto")
    if alpha not in (None, "auto") and not _count(alpha):
        errors[f"{_FRAME}.cost_alpha"] = f"{alpha!r}: must be auto (3 x the vision width), null (auto) or a " \
                                         "whole number >= 0"
    return errors


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def frame_sharding(cfg: Config) -> dict[str, Any] | None:
    """The ``distributed.multimodal.vision.frame_sharding`` settings when enabled (None: off or not given)."""
    settings = cfg.distributed
    value = settings.multimodal if settings is not None and isinstance(settings.multimodal, dict) else {}
    frames = (value.get("vision") or {}).get("frame_sharding") or {}
    return frames if frames.get("enabled", False) is True else None


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
    if "frame_sharding" in (value.get("vision") or {}) and frame_sharding(cfg) is None:
        notes.append("note: distributed.multimodal.vision.frame_sharding governs nothing this run: it is off "
                     "(enabled: false), every rank runs the whole vision encoder on its own batch")
    elif frame_sharding(cfg) is not None and settings.cp_size == 1:
        notes.append("note: distributed.multimodal.vision.frame_sharding governs nothing this run: it splits the "
                     "vision encoder's frames over the context-parallel ranks (cp_size > 1); with cp_size 1 every "
                     "rank runs the whole vision encoder on its own batch")
    return notes
