"""Notes for settings that govern nothing in a run: upstream's ``distributed`` keys outside the layout they act in
(upstream ignores them then too), DDP's options in one process, and ``model.backend`` values that describe what
the run does anyway. Each names the key, its value and why; the run logs them before it builds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel.model_backend import backend_setting
from automodel.training.dist import expected_world_size
from automodel.training.multimodal_section import multimodal_notes
from automodel.training.parallel.offload import offload_notes

if TYPE_CHECKING:
    from automodel.config import Config


def inert_distributed_notes(cfg: Config, fsdp2: bool) -> list[str]:
    """Notes naming upstream's ``distributed`` keys (and ``model.backend.enable_fsdp_optimizations`` /
    ``enable_hf_state_dict_adapter``) that govern nothing in this run (upstream ignores them too)."""
    notes = []
    if backend_setting(cfg.model, "enable_hf_state_dict_adapter") is False:
        notes.append("note: model.backend.enable_hf_state_dict_adapter: false keeps a model's own weight layout in "
                     "its checkpoints; the Hugging Face models trained here have no state-dict adapter, and their own "
                     "layout is the Hugging Face layout, which the checkpoints hold as with true")
    optimized = backend_setting(cfg.model, "enable_fsdp_optimizations")
    if optimized and not fsdp2:
        notes.append("note: model.backend.enable_fsdp_optimizations: true governs nothing this run: it acts on FSDP2 "
                     "models (distributed.strategy: fsdp2, more than one process) with gradient accumulation")
    settings = cfg.distributed
    if optimized and fsdp2 and settings is not None and not settings.defer_fsdp_grad_sync:
        notes.append("note: distributed.defer_fsdp_grad_sync: false governs nothing this run: model.backend."
                     "enable_fsdp_optimizations: true defers the gradient sync to the step's last micro-batch (as "
                     "upstream's models with these optimizations do)")
    if settings is None:
        return notes
    notes += multimodal_notes(cfg, fsdp2) + offload_notes(cfg, fsdp2)
    for name, size, what in (("pipeline", settings.pp_size, "pipeline parallelism (pp_size)"),
                             ("moe", settings.ep_size or 1, "expert parallelism (ep_size)")):
        if getattr(settings, name) is not None and size == 1:
            notes.append(f"note: distributed.{name} governs nothing this run: {what} is off, and upstream ignores "
                         "these settings then too")
    moe = settings.moe if isinstance(settings.moe, dict) and (settings.ep_size or 1) > 1 else {}
    if "ignore_router_for_ac" in moe and not settings.activation_checkpointing:
        notes.append("note: distributed.moe.ignore_router_for_ac governs nothing this run: it chooses how "
                     "activation checkpointing treats the routing, and distributed.activation_checkpointing is off")
    if moe.get("wrap_outer_model") is True:
        notes.append("note: distributed.moe.wrap_outer_model: true is what FSDP2 here does anyway (the whole model "
                     "is the root unit)")
    if settings.strategy == "ddp" and expected_world_size() <= 1:
        for name, value in settings.ddp_options_given().items():
            notes.append(f"note: distributed.{name}: {str(value).lower()} governs nothing this run: it is an option "
                         "of DDP, which runs with more than one process")
    for name, given in (("defer_fsdp_grad_sync", not settings.defer_fsdp_grad_sync),
                        ("reshard_after_forward", settings.reshard_after_forward is not None)):
        if given and not fsdp2:
            notes.append(f"note: distributed.{name}: {str(getattr(settings, name)).lower()} governs nothing this "
                         "run: it acts on FSDP2 models (distributed.strategy: fsdp2, more than one process)")
    return notes
