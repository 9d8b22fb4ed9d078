"""The VLM freeze stage (pipeline slot ``freeze``): vision tower, projector, language model, embeddings, patterns.

``freeze.vision_tower`` is true by default, so the stage always runs for this domain: the usual recipe trains the
projector and the language model on top of a fixed image encoder.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from automodel.errors import AutomodelError
from automodel.training.context import BuildContext
from automodel.training.sections import FreezeConfig
from automodel.training.stages.freeze import unfrozen
from automodel_vlm.parts import PART_NAMES, base_model, part_parameters


@dataclass
class VLMFreezeConfig(FreezeConfig):
    vision_tower: bool = field(default=True, metadata={"help": "freeze the vision tower (image encoder)"})
    multi_modal_projector: bool = field(default=False, metadata={
        "help": "freeze the projector from image features to the language model", "aliases": ("projector",)})
    language_model: bool = field(default=False, metadata={
        "help": "freeze the language model and its output head (LoRA adapters still train)"})

    def freezes_anything(self) -> bool:
        return super().freezes_anything() or self.vision_tower or self.multi_modal_projector or self.language_model


def _is_adapter(name: str) -> bool:
    return "lora_" in name or ".modules_to_save." in name


def freeze_vlm(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """Freeze the parts the ``freeze`` section names; ``unfreeze_modules`` patterns stay trainable."""
    cfg = ctx.cfg.freeze
    names = {id(p): n for n, p in model.named_parameters()}
    chosen: dict[int, str] = {}  # parameter id -> why
    for part in PART_NAMES:
        if not getattr(cfg, part, False):
            continue
        params = part_parameters(model, part)
        if params is None:
            raise AutomodelError(f"freeze.{part}: {type(base_model(model)).__name__} has no module named like "
                                 f"{' / '.join(PART_NAMES[part])}; set freeze.{part}: false and name its parameters "
                                 "in freeze.patterns")
        for p in params:
            if not _is_adapter(names.get(id(p), "")):
                chosen.setdefault(id(p), part)
    if cfg.embeddings:
        embeddings = base_model(model).get_input_embeddings()
        for p in embeddings.parameters():
            chosen.setdefault(id(p), "embeddings")
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatch(name, pattern) for pattern in cfg.patterns):
            chosen.setdefault(id(p), "patterns")
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        if id(p) not in chosen:
            continue
        if unfrozen(name, cfg.unfreeze_modules):
            continue
        p.requires_grad_(False)
        counts[chosen[id(p)]] = counts.get(chosen[id(p)], 0) + 1
    total = sum(1 for _ in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    detail = ", ".join(f"{why} {n}" for why, n in counts.items()) or "nothing"
    return model, f"froze {sum(counts.values())} of {total} parameter tensors ({detail}); {trainable} parameters train"
