"""Image-caption data through ``datasets`` (images decoded by Pillow): a JSONL file, an image folder, a hub set.

Sources ``ImageCaptionDataset(path=...)`` reads:

* a JSONL file of ``{"image": "relative/or/absolute.png", "caption": "..."}`` (paths relative to the file);
* a directory holding ``<split>.jsonl`` (the same format), or ``metadata.jsonl`` in the Hugging Face imagefolder
  convention (``{"file_name": ..., "caption": ...}``), or images with same-named ``.txt`` caption files;
* anything else is a ``datasets.load_dataset`` name (with ``image_column`` / ``caption_column``).

Each sample is ``{"pixel_values": float tensor (3, resolution, resolution) in [-1, 1], "caption": str}``.

``VideoCaptionDataset(path=...)`` reads clips the same ways from a directory: ``<split>.jsonl`` / ``metadata.jsonl``
rows ``{"video" (or "file_name"): ..., "caption": ...}``, or clips directly in the directory with same-named ``.txt``
captions beside them. A clip is an animated GIF / WebP, or a folder of frame images (in name order); its samples are
``(3, frames, resolution, resolution)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
ANIMATION_SUFFIXES = (".gif", ".webp")  # clips Pillow decodes frame by frame


def jsonl_rows(path: Path, key: str) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed row)`` of each non-blank line of a JSON-lines file; a line that is not JSON stops
    with an error naming the config ``key``, the file and the line."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise AutomodelError(f"{key}: {path}:{number} is not JSON: {err}") from None


def _read_jsonl(path: Path, image_key: str, caption_key: str, bad_rows: BadRows,
                exists: Callable[[Path], bool] = Path.is_file, kind: str = "image") -> tuple[list[str], list[str]]:
    images, captions = [], []
    for number, row in jsonl_rows(path, "dataset.path"):
        keys = tuple(dict.fromkeys(k for k in (image_key, kind if kind == "image" else None, "file_name") if k))
        image = next((row[k] for k in keys if row.get(k) is not None), None) if isinstance(row, dict) else None
        if image is None or not isinstance(row.get(caption_key), str):
            found = sorted(row) if isinstance(row, dict) else type(row).__name__
            bad_rows.bad(number - 1, f"(line {number}) needs '{image_key}' (or 'file_name') and a text "
                                     f"'{caption_key}', found {found}")
            continue
        file = Path(image)
        file = file if file.is_absolute() else path.parent / file
        if not exists(file):
            bad_rows.bad(number - 1, f"(line {number}) its {kind} '{image}' does not exist (looked for '{file}')")
            continue
        images.append(str(file))
        captions.append(row[caption_key])
    return images, captions


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


def _clips(folder: Path) -> list[Path]:
    """Animated GIF / WebP files and folders of frame images directly in ``folder``."""
    return sorted(p for p in folder.iterdir() if (p.is_file() and p.suffix.lower() in ANIMATION_SUFFIXES)
                  or (p.is_dir() and any(f.suffix.lower() in IMAGE_SUFFIXES for f in p.iterdir())))


def _read_folder(folder: Path, split: str, image_key: str, caption_key: str, bad_rows: BadRows,
                 kind: str = "image") -> tuple[list[str], list[str]]:
    """A folder's ``<split>.jsonl`` / ``metadata.jsonl``, else its images (``kind`` clip: clips) with ``.txt``
    captions beside them."""
    exists = Path.is_file if kind == "image" else Path.exists
    for name in (f"{split}.jsonl", "metadata.jsonl"):
        if (folder / name).is_file():
            bad_rows.source = str(folder / name)
            return _read_jsonl(folder / name, image_key, caption_key, bad_rows, exists, kind)
    items = _images(folder) if kind == "image" else _clips(folder)
    missing = [p.name for p in items if not p.with_suffix(".txt").is_file()]
    if missing:
        raise AutomodelError(f"dataset.path: '{folder}' has no {split}.jsonl or metadata.jsonl, and {len(missing)} "
                             f"{kind}s have no caption file (.txt beside the {kind}), e.g. {missing[0]}")
    captions = [p.with_suffix(".txt").read_text(encoding="utf-8").strip() for p in items]
    return [str(p) for p in items], captions


def load_image_captions(path: str, split: str = "train", image_column: str = "image",
                        caption_column: str = "caption", on_bad_row: OnBadRow = "error") -> Any:
    """A ``datasets.Dataset`` with an ``image`` column (decoded by Pillow) and a ``caption`` column."""
    import datasets

    source = Path(path)
    bad_rows = BadRows(on_bad_row, str(path), "dataset")
    if source.is_file() or source.is_dir():
        images, captions = (_read_jsonl(source, image_column, caption_column, bad_rows) if source.is_file()
                            else _read_folder(source, split, image_column, caption_column, bad_rows))
        bad_rows.report()
        if not images:
            raise AutomodelError(f"dataset.path: '{path}' has no usable rows")
        table = datasets.Dataset.from_dict({"image": images, "caption": captions})
        return table.cast_column("image", datasets.Image())
    try:
        table = datasets.load_dataset(path, split=split)
    except Exception as err:  # noqa: BLE001 - datasets raises many types; the user needs the message
        raise AutomodelError(f"dataset.path: '{path}' is not a file, a directory or a loadable data set: "
                             f"{type(err).__name__}: {err}") from None
    for column in (image_column, caption_column):
        if column not in table.column_names:
            raise AutomodelError(f"dataset: '{path}' has no column '{column}' (it has: "
                                 f"{', '.join(table.column_names)}); set image_column / caption_column")
    table = table.select_columns([image_column, caption_column])
    table = table.rename_columns({image_column: "image", caption_column: "caption"})
    keep = []
    for index, caption in enumerate(table["caption"]):
        if not isinstance(caption, str):
            bad_rows.bad(index, f"the field '{caption_column}' is " + ("null" if caption is None else "not text"))
        else:
            keep.append(index)
    bad_rows.report()
    if len(keep) < len(table):
        table = table.select(keep)
    return table.cast_column("image", datasets.Image())


def image_to_tensor(image: Any, resolution: int, center_crop: bool = True) -> torch.Tensor:
    """A Pillow image -> (3, resolution, resolution) float tensor in [-1, 1] (shorter side resized, then cropped)."""
    from PIL import Image

    image = image.convert("RGB")
    width, height = image.size
    scale = resolution / min(width, height)
    size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
    if size != image.size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    left = (size[0] - resolution) // 2 if center_crop else 0
    top = (size[1] - resolution) // 2 if center_crop else 0
    image = image.crop((left, top, left + resolution, top + resolution))
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class ImageCaptionDataset(torch.utils.data.Dataset):
    """Images and captions for text-to-image training (see the module docstring for the sources). A row without
    an image or a text caption, or whose image file does not exist, is refused, or skipped with
    ``on_bad_row: skip``."""

    def __init__(self, path: str, resolution: int = 512, split: str = "train", image_column: str = "image",
                 caption_column: str = "caption", center_crop: bool = True, random_flip: bool = False,
                 limit_samples: int | None = None, on_bad_row: OnBadRow = "error"):
        if resolution < 8:
            raise AutomodelError(f"dataset.resolution: {resolution} is too small (at least 8 pixels)")
        self.data = load_image_captions(path, split, image_column, caption_column, on_bad_row)
        if limit_samples is not None:
            self.data = self.data.select(range(min(limit_samples, len(self.data))))
        self.resolution, self.center_crop, self.random_flip = resolution, center_crop, random_flip

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.data[int(index)]
        pixels = image_to_tensor(row["image"], self.resolution, self.center_crop)
        if self.random_flip and torch.rand(()) < 0.5:  # torch's RNG: saved with the run's RNG state
            pixels = pixels.flip(-1)
        return {"pixel_values": pixels, "caption": row["caption"]}

    @property
    def captions(self) -> list[str]:
        return list(self.data["caption"])


def collate_image_captions(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {"pixel_values": torch.stack([s["pixel_values"] for s in samples]),
            "captions": [s["caption"] for s in samples]}


def read_frames(path: str) -> list[Any]:
    """A clip's frames as RGB Pillow images: an animated GIF / WebP's frames, or a folder's images in name order."""
    from PIL import Image, ImageSequence

    source = Path(path)
    if source.is_dir():
        return [Image.open(f).convert("RGB") for f in sorted(source.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
    with Image.open(source) as clip:
        return [frame.convert("RGB") for frame in ImageSequence.Iterator(clip)]


def frame_count(path: str) -> int:
    """A clip's frame count without decoding its frames."""
    from PIL import Image

    source = Path(path)
    if source.is_dir():
        return sum(f.suffix.lower() in IMAGE_SUFFIXES for f in source.iterdir())
    with Image.open(source) as clip:
        return getattr(clip, "n_frames", 1)


class VideoCaptionDataset(torch.utils.data.Dataset):
    """Clips and captions for text-to-video training (see the module docstring for the sources): the first
    ``num_frames`` frames of each clip (None: every frame, and every clip must have as many), each resized and
    centre-cropped to ``resolution`` as ImageCaptionDataset does. A row whose clip does not exist or is shorter than
    ``num_frames`` is refused, or skipped with ``on_bad_row: skip``."""

    def __init__(self, path: str, resolution: int = 512, num_frames: int | None = None, split: str = "train",
                 video_column: str = "video", caption_column: str = "caption", center_crop: bool = True,
                 limit_samples: int | None = None, on_bad_row: OnBadRow = "error"):
        if resolution < 8:
            raise AutomodelError(f"dataset.resolution: {resolution} is too small (at least 8 pixels)")
        if num_frames is not None and num_frames < 1:
            raise AutomodelError(f"dataset.num_frames: must be >= 1, found {num_frames}")
        source = Path(path)
        if not source.is_dir():
            raise AutomodelError(f"dataset.path: '{path}' is not a directory of clips and captions")
        bad_rows = BadRows(on_bad_row, str(path), "dataset")
        clips, captions = _read_folder(source, split, video_column, caption_column, bad_rows, kind="clip")
        counts = [frame_count(clip) for clip in clips]
        keep = []
        for index, count in enumerate(counts):
            if num_frames is not None and count < num_frames:
                bad_rows.bad(index, f"the clip '{clips[index]}' has {count} frames, fewer than num_frames "
                                    f"({num_frames})")
            else:
                keep.append(index)
        bad_rows.report()
        if not keep:
            raise AutomodelError(f"dataset.path: '{path}' has no clips (animated .gif / .webp files or folders of "
                                 "frame images, with .txt captions beside them, or listed in metadata.jsonl)")
        if num_frames is None and len({counts[i] for i in keep}) > 1:
            sizes = ", ".join(f"{Path(clips[i]).name}: {counts[i]}" for i in keep[:4])
            raise AutomodelError(f"dataset.num_frames: the clips in '{path}' have different frame counts ({sizes}); "
                                 "set num_frames to train on the first num_frames frames of each")
        keep = keep[:limit_samples] if limit_samples is not None else keep
        self.clips, self.caption_list = [clips[i] for i in keep], [captions[i] for i in keep]
        self.num_frames = num_frames or counts[keep[0]]
        self.resolution, self.center_crop = resolution, center_crop

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> dict[str, Any]:
        frames = read_frames(self.clips[int(index)])[: self.num_frames]
        pixels = torch.stack([image_to_tensor(f, self.resolution, self.center_crop) for f in frames], dim=1)
        return {"pixel_values": pixels, "caption": self.caption_list[int(index)]}

    @property
    def captions(self) -> list[str]:
        return list(self.caption_list)
