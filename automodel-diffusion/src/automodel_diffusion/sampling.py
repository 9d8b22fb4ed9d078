"""Sample images (or videos) from a diffusers pipeline with fixed prompts and seeds, tile them into one grid, and
write videos as animated WebP (Pillow; no video encoder needed) and audio as WAV (Python's wave module)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

DEFAULT_FPS = 16  # what upstream's generation writes videos at unless output.fps says otherwise


def call_kwargs(pipeline: Any, **candidates: Any) -> dict[str, Any]:
    """The ``candidates`` (not None) that the pipeline's ``__call__`` accepts."""
    params = inspect.signature(type(pipeline).__call__).parameters
    return {k: v for k, v in candidates.items() if v is not None and k in params}


def takes_guidance_scale(pipeline: Any) -> bool:
    """Whether the pipeline's ``__call__`` takes ``guidance_scale`` (HunyuanVideo 1.5's guides through its
    ``guider`` component instead)."""
    return "guidance_scale" in inspect.signature(type(pipeline).__call__).parameters


def use_guidance_scale(pipeline: Any, scale: float) -> Any:
    """For a pipeline whose classifier-free guidance is its ``guider`` component: that guider at ``scale`` in its
    place; returns the guider it replaced (to put back)."""
    previous = pipeline.guider
    pipeline.guider = previous.new(guidance_scale=scale)
    return previous


def sample_images(pipeline: Any, prompts: list[str], images_per_prompt: int, seed: int, steps: int,
                  guidance_scale: float, height: int | None, width: int | None, **kwargs: Any) -> list[Any]:
    """Row-major images (a video pipeline: videos, each a list of frames): row r, column c is prompt c with seed
    ``seed + r * len(prompts) + c``. A video pipeline draws one video per call (a batch of videos is decoded at
    once, which HunyuanVideo 1.5's VAE cannot); a pipeline guided by its ``guider`` samples with that guider at
    ``guidance_scale``.

    Every draw comes from per-image CPU generators, so sampling never moves the training RNG.
    """
    batch = [p for _ in range(images_per_prompt) for p in prompts]
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(batch))]
    size = {k: v for k, v in (("height", height), ("width", width)) if v is not None}
    guided = takes_guidance_scale(pipeline) or getattr(pipeline, "guider", None) is None
    settings = {"num_inference_steps": steps, "output_type": "pil", **size, **kwargs,
                **({"guidance_scale": guidance_scale} if guided else {})}
    if "num_frames" not in inspect.signature(type(pipeline).__call__).parameters:
        return list(pipeline(prompt=batch, generator=generators, **settings).images)
    previous = None if guided else use_guidance_scale(pipeline, guidance_scale)
    try:
        return [list(pipeline(prompt=[p], generator=[g], **settings).frames[0]) for p, g in zip(batch, generators,
                                                                                                 strict=True)]
    finally:
        if previous is not None:
            pipeline.guider = previous


def sample_edits(pipeline: Any, edits: list[tuple[str, list[Any]]], images_per_prompt: int, seed: int, steps: int,
                 guidance_scale: float, height: int | None, width: int | None, **kwargs: Any) -> list[Any]:
    """``sample_images`` for an image-editing pipeline: ``edits`` are (instruction, source images) pairs, each
    edited alone (QwenImageEditPlusPipeline takes one prompt per call), in the same row-major order and seeds."""
    size = {k: v for k, v in (("height", height), ("width", width)) if v is not None}
    images = []
    for index in range(images_per_prompt * len(edits)):
        prompt, sources = edits[index % len(edits)]
        output = pipeline(prompt=[prompt], image=sources, num_inference_steps=steps, guidance_scale=guidance_scale,
                          generator=torch.Generator().manual_seed(seed + index), output_type="pil", **size, **kwargs)
        images.append(output.images[0])
    return images


def image_grid(images: list[Any], rows: int, columns: int) -> Any:
    from PIL import Image

    width, height = images[0].size
    grid = Image.new("RGB", (columns * width, rows * height), (255, 255, 255))
    for i, image in enumerate(images):
        grid.paste(image.convert("RGB"), ((i % columns) * width, (i // columns) * height))
    return grid


def save_video(frames: list[Any], path: Path, fps: float) -> None:
    """Frames (Pillow images) as a looping animated WebP at ``fps`` (each frame shown round(1000 / fps) ms)."""
    first, *rest = [frame.convert("RGB") for frame in frames]
    first.save(path, format="WEBP", save_all=True, append_images=rest, duration=round(1000 / fps), loop=0,
               lossless=True)


def save_audio(waveform: torch.Tensor, path: Path, sample_rate: int) -> None:
    """A (channels, samples) waveform in [-1, 1] as a 16-bit PCM WAV file (Python's wave module writes it)."""
    import wave

    pcm = (waveform.detach().float().cpu().clamp(-1, 1) * 32767).round().to(torch.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(pcm.shape[0])
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.t().contiguous().numpy().tobytes())
