"""Video clips for the conversation data, read with Pillow (no video decoder is installed here): an animated GIF or
WebP file (its frames and their display durations) or a folder of frame images (sorted by name, at the ``fps`` the
row gives). A clip is its frames as one ``(T, H, W, 3)`` uint8 array and its frame rate, which the processor's video
processor samples frames by and writes timestamps from (``video_metadata``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ANIMATIONS = (".gif", ".webp")
FRAME_IMAGES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
CONVERT = ("convert it to an animated GIF / WebP or a folder of frame images (e.g. `ffmpeg -i clip.mp4 "
           "frames/%05d.png`, and give the row's video part an fps)")


@dataclass
class Clip:
    frames: np.ndarray  # (T, H, W, 3) uint8
    fps: float

    @property
    def metadata(self) -> dict[str, Any]:
        """The clip as transformers' ``VideoMetadata`` reads it."""
        count, height, width = self.frames.shape[:3]
        return {"total_num_frames": count, "fps": self.fps, "height": height, "width": width,
                "duration": count / self.fps}


def frame_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in FRAME_IMAGES)


def clip_issue(path: Path, fps: float | None) -> str | None:
    """Why ``path`` cannot be read as a clip (None: it can), checked when the data set is built."""
    if path.is_dir():
        if not frame_files(path):
            return f"frame folder '{path}' holds no images ({', '.join(FRAME_IMAGES)})"
        if fps is None:
            return (f"frame folder '{path}' gives no frame rate; add \"fps\" to the video part (the frames per "
                    "second the images were taken at)")
        return None
    if not path.is_file():
        return f"video '{path}' not found"
    if path.suffix.lower() not in ANIMATIONS:
        return (f"video '{path}': {path.suffix or 'this'} files cannot be read here (no video decoder: av, decord "
                f"or torchcodec is installed); {CONVERT}")
    return None


def _rgb(image: Any) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def read_clip(path: Path, fps: float | None = None) -> Clip:
    """The clip at ``path``; ``fps`` overrides an animation's own rate (from its frames' mean duration)."""
    from PIL import Image, ImageSequence

    if path.is_dir():
        frames = []
        for file in frame_files(path):
            with Image.open(file) as image:
                frames.append(_rgb(image))
        sizes = {frame.shape for frame in frames}
        if len(sizes) > 1:
            raise ValueError(f"frame folder '{path}': the frames differ in size ({sorted(sizes)}); give one size")
        return Clip(np.stack(frames), float(fps))
    with Image.open(path) as animation:
        frames, durations = [], []
        for frame in ImageSequence.Iterator(animation):
            frames.append(_rgb(frame))
            durations.append(frame.info.get("duration") or 0)
    if fps is None:
        if not all(durations):
            raise ValueError(f"video '{path}' does not say how long its frames show; add \"fps\" to the video part")
        fps = 1000.0 * len(durations) / sum(durations)
    return Clip(np.stack(frames), float(fps))
