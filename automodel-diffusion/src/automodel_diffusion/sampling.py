"""Sample images from a diffusers pipeline with fixed prompts and seeds, and tile them into one PNG grid."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def call_kwargs(pipeline: Any, **candidates: Any) -> dict[str, Any]:
    """The ``candidates`` (not None) that the pipeline's ``__call__`` accepts."""
    params = inspect.signature(type(pipeline).__call__).parameters
    return {k: v for k, v in candidates.items() if v is not None and k in params}


def sample_images(pipeline: Any, prompts: list[str], images_per_prompt: int, seed: int, steps: int,
                  guidance_scale: float, height: int | None, width: int | None, **kwargs: Any) -> list[Any]:
    """Row-major images: row r, column c is prompt c with seed ``seed + r * len(prompts) + c``.

    Every draw comes from per-image CPU generators, so sampling never moves the training RNG.
    """
    batch = [p for _ in range(images_per_prompt) for p in prompts]
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(batch))]
    size = {k: v for k, v in (("height", height), ("width", width)) if v is not None}
    output = pipeline(prompt=batch, num_inference_steps=steps, guidance_scale=guidance_scale, generator=generators,
                      output_type="pil", **size, **kwargs)
    return list(output.images)


def image_grid(images: list[Any], rows: int, columns: int) -> Any:
    from PIL import Image

    width, height = images[0].size
    grid = Image.new("RGB", (columns * width, rows * height), (255, 255, 255))
    for i, image in enumerate(images):
        grid.paste(image.convert("RGB"), ((i % columns) * width, (i // columns) * height))
    return grid
