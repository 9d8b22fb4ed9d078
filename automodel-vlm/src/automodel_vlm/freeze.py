"""The VLM freeze stage (pipeline slot ``freeze``): vision tower, projector, language model, embeddings, patterns.

``freeze.vision_tower`` is true by default, so the stage always runs for this domain: the usual recipe trains the
projector and the language model on top of a fixed image encoder.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from automodel.errors import AutomodelError
from automodel.hf import is_adapter_tensor
from automodel.training.context import BuildContext
from automodel.training.sections import FreezeConfig
from automodel.training.stages.freeze import unfrozen
from automodel_vlm.parts import PART_NAMES, base_model, embedding, held_by_another_stage, part_parameters


@dataclass
class VLMFreezeConfig(FreezeConfig):
    vision_tower: bool = field(default=True, metadata={"help": "freeze the vision tower (image encoder)"})
    multi_modal_projector: bool = field(default=False, metadata={
        "help": "freeze the projector from image features to the language model", "aliases": ("projector",)})
    language_model: bool = field(default=False, metadata={
        "help": "freeze the language model and its output head (LoRA adapters still train)"})

    def freezes_anything(self) -> bool:
        return super().freezes_anything() or self.vision_tower or self.multi_modal_projector or self.language_model


@dataclass
class UpstreamFreezeConfig:
    """Upstream's ``freeze_config:`` (its defaults): a part is frozen by its attribute and by every module whose
    name contains one of the part's words, as upstream's apply_parameter_freezing does."""

    freeze_vision_tower: bool = field(default=True, metadata={
        "help": "freeze the vision tower (modules named like vision / visual / image_encoder)"})
    freeze_audio_tower: bool = field(default=False, metadata={
        "help": "freeze the audio tower (audio / audio_encoder / speech / sound), if the model has one"})
    freeze_language_model: bool = field(default=False, metadata={
        "help": "freeze the language model (modules named like language / text / llm; the output head stays "
                "trainable, as upstream)"})
    freeze_video_embedder: bool = field(default=False, metadata={
        "help": "freeze patch_generator.video_embedder parameters (RADIO vision towers)"})
    freeze_embeddings: bool = field(default=False, metadata={
        "help": "freeze the input embeddings (upstream reads this key nowhere; here it acts)"})


# freeze_config key -> (the model attribute, the words a module name may contain), as upstream matches them
UPSTREAM_PARTS = {
    "freeze_vision_tower": ("vision_tower", ("vision", "visual", "image_encoder")),
    "freeze_audio_tower": ("audio_tower", ("audio", "audio_encoder", "speech", "sound")),
    "freeze_language_model": ("language_model", ("language", "text", "llm")),
}


def upstream_choice(model: torch.nn.Module, settings: UpstreamFreezeConfig) -> dict[int, str]:
    """Parameter id -> the freeze_config key that freezes it."""
    inner = base_model(model)
    chosen: dict[int, str] = {}
    for key, (attribute, words) in UPSTREAM_PARTS.items():
        if not getattr(settings, key):
            continue
        owner = getattr(inner, attribute, None)
        modules = [owner] if isinstance(owner, torch.nn.Module) else []
        modules += [m for name, m in inner.named_modules() if any(word in name.lower() for word in words)]
        for module in modules:
            for p in module.parameters():
                chosen.setdefault(id(p), key)
    if settings.freeze_video_embedder:
        for name, p in inner.named_parameters():
            if "patch_generator.video_embedder" in name:
                chosen.setdefault(id(p), "freeze_video_embedder")
    if settings.freeze_embeddings:
        embeddings = embedding(model, "get_input_embeddings")  # None: a later pipeline stage
        for p in embeddings.parameters() if embeddings is not None else []:
            chosen.setdefault(id(p), "freeze_embeddings")
    return chosen


def freeze_vlm(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """Freeze the parts the ``freeze`` section names (``unfreeze_modules`` patterns stay trainable), or those
    upstream's ``freeze_config`` names, matched as upstream matches them. LoRA adapters are never frozen."""
    cfg = ctx.cfg.freeze
    names = {id(p): n for n, p in model.named_parameters()}
    if "freeze_config" in ctx.cfg:
        chosen = {i: why for i, why in upstream_choice(model, ctx.cfg.freeze_config).items()
                  if not is_adapter_tensor(names.get(i, ""))}
        return _apply(model, chosen, [])
    chosen: dict[int, str] = {}  # parameter id -> why
    for part in PART_NAMES:
        if not getattr(cfg, part, False):
            continue
        params = part_parameters(model, part)
        if params is None and held_by_another_stage(model, part):
            continue
        if params is None:
            raise AutomodelError(f"freeze.{part}: {type(base_model(model)).__name__} has no module named like "
                                 f"{' / '.join(PART_NAMES[part])}; set freeze.{part}: false and name its parameters "
                                 "in freeze.patterns")
        for p in params:
            if not is_adapter_tensor(names.get(id(p), "")):
                chosen.setdefault(id(p), part)
    if cfg.embeddings:
        embeddings = embedding(model, "get_input_embeddings")  # None: a later pipeline stage
        for p in embeddings.parameters() if embeddings is not None else []:
            chosen.setdefault(id(p), "embeddings")
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatch(name, pattern) for pattern in cfg.patterns):
            chosen.setdefault(id(p), "patterns")
    return _apply(model, chosen, cfg.unfreeze_modules)


def _apply(model: torch.nn.Module, chosen: dict[int, str], unfreeze: list[str]) -> tuple[torch.nn.Module, str]:
    """Freeze the chosen parameters (but those ``unfreeze`` patterns keep) and say how many, and why."""
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        if id(p) not in chosen:
            continue
        if unfrozen(name, unfreeze):
            continue
        p.requires_grad_(False)
        counts[chosen[id(p)]] = counts.get(chosen[id(p)], 0) + 1
    total = sum(1 for _ in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    detail = ", ".join(f"{why} {n}" for why, n in counts.items()) or "nothing"
    return model, f"froze {sum(counts.values())} of {total} parameter tensors ({detail}); {trainable} parameters train"
