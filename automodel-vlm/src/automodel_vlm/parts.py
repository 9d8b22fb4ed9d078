"""Where a vision-language model keeps its vision tower, projector and language model.

Found by module name (transformers' conventions across architectures), through peft and DDP wrappers, so the
freeze and LoRA stages work on any image-text-to-text model that follows them.
"""

from __future__ import annotations

from typing import Any

import torch

from automodel.training.modules import unwrap

PART_NAMES = {
    "vision_tower": ("vision_tower", "visual", "vision_model", "vision_encoder", "image_encoder"),
    "multi_modal_projector": ("multi_modal_projector", "mm_projector", "connector", "vision_projection"),
    "language_model": ("language_model", "text_model", "llm"),
}

# Every module FSDP2 treats as multimodal (distributed.multimodal.frozen_sharding): the vision tower and projector
# names above, audio towers, and the embedders that map a tower's output into the text (Gemma's embed_vision).
MULTIMODAL_NAMES = (*PART_NAMES["vision_tower"], *PART_NAMES["multi_modal_projector"], "audio_tower",
                    "audio_encoder", "audio_model", "embed_vision", "embed_audio")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside torch.compile / DDP / peft wrappers."""
    model = unwrap(model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def find_part(model: torch.nn.Module, part: str) -> tuple[str, torch.nn.Module] | None:
    """(name, module) of the outermost module called like ``part`` (names relative to ``base_model(model)``)."""
    names = PART_NAMES[part]
    found = [(name, module) for name, module in base_model(model).named_modules()
             if name and name.rsplit(".", 1)[-1] in names]
    if not found:
        return None
    return min(found, key=lambda item: item[0].count("."))


def part_parameters(model: torch.nn.Module, part: str) -> list[torch.nn.Parameter] | None:
    """The parameters of one part (the language model's include its output head); None: no such part."""
    located = find_part(model, part)
    if located is None:
        return None
    params = list(located[1].parameters())
    if part == "language_model":
        head = embedding(model, "get_output_embeddings")
        if isinstance(head, torch.nn.Module):
            params += [p for p in head.parameters() if all(p is not q for q in params)]
    return params


def whole_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model a pipeline stage was cut from, while the build pipeline runs (None: not a stage)."""
    return getattr(base_model(model), "whole_model", None)


def held_by_another_stage(model: torch.nn.Module, part: str) -> bool:
    """Whether ``model`` is a pipeline stage without ``part``, which the model it was cut from has (another stage
    holds it: the vision tower and projector are the first stage's)."""
    whole = whole_model(model)
    return whole is not None and find_part(model, part) is None and find_part(whole, part) is not None


def embedding(model: torch.nn.Module, getter: str) -> torch.nn.Module | None:
    """The model's input or output embedding (``getter``: ``get_input_embeddings`` / ``get_output_embeddings``); on
    a pipeline stage the one it holds, found under the whole model's name for it (None: another stage holds it)."""
    inner, whole = base_model(model), whole_model(model)
    if whole is None:
        return getattr(inner, getter, lambda: None)()
    wanted = getattr(whole, getter)()
    name = next((name for name, module in whole.named_modules() if module is wanted), None)
    return dict(inner.named_modules()).get(name) if name is not None else None


def describe(model: Any) -> str:
    parts = {part: find_part(model, part) for part in PART_NAMES}
    return ", ".join(f"{part}={found[0] if found else '-'}" for part, found in parts.items())
