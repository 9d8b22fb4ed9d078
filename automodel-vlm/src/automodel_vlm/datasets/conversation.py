"""Image-text conversations from local JSONL/JSON/parquet (or a hub data set) through ``datasets``.

A row holds a conversation (``messages``: ``{role, content}`` with content a string or a list of
``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts) and its images: in an image column (a path
relative to ``image_root``, which defaults to the data file's folder; a list of paths; image bytes; a decoded
``datasets.Image``), or inline in the image parts (``{"type": "image", "image": "a.png"}``, or ``path``).
Images are opened with Pillow when a sample is read; every path is checked when the data set is built, so a
missing file fails at start-up with its row.

A video is a ``{"type": "video", "video": "clip.gif"}`` part (or ``path``; ``fps`` optional): an animated GIF / WebP
or a folder of frame images (then ``fps`` is needed), read with Pillow (videos.py) and passed to the processor
whole with its frame rate; its video processor samples the frames (``fps`` / ``max_frames`` / ``num_frames``).
Other video files are refused with the reason (no video decoder is installed).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError
from automodel_vlm.datasets.videos import clip_issue, read_clip

_INLINE_KEYS = ("image", "path", "url", "image_url")
_VIDEO_KEYS = ("video", "path", "url")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def _data_file(path: Path, split: str) -> Path | None:
    """``<dir>/<split>.jsonl`` (or .json/.parquet) of a local folder."""
    for suffix in _DATA_SUFFIXES:
        candidate = path / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def load_conversation_rows(path_or_dataset_id: str, split: str, key: str) -> tuple[Any, Path | None]:
    """(rows, the folder relative image paths start from) for a file, a folder with ``<split>.jsonl``, or a hub name."""
    from automodel.data import load_rows

    path = Path(str(path_or_dataset_id))
    if path.is_dir():
        data = _data_file(path, split)
        if data is None:
            raise AutomodelError(f"{key}: folder '{path}' has no {split}.jsonl, {split}.json or {split}.parquet; "
                                 "point it at the data file")
        path = data
    rows = load_rows(str(path), split, key=key)
    return rows, (path.parent if path.is_file() else None)


def _undecoded(rows: Any, column: str | None) -> Any:
    """Image columns read as ``{bytes, path}`` (decoded lazily, per sample) rather than as PIL images."""
    import datasets

    if column is None or column not in rows.column_names:
        return rows
    feature = rows.features[column]
    if isinstance(feature, datasets.Image):
        return rows.cast_column(column, datasets.Image(decode=False))
    if isinstance(getattr(feature, "feature", None), datasets.Image):  # a list of images
        return rows.cast_column(column, type(feature)(datasets.Image(decode=False)))
    return rows


def _clean(value: Any) -> Any:
    """Arrow's struct unification fills absent keys with None: drop them, recursively."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _parts(content: Any) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, dict):
        return [content]
    return list(content)


class ImageTextChatDataset(Dataset):
    """Rows of one conversation each with its images (and videos); samples are ``{"messages", "images"}`` (PIL, RGB),
    plus ``"videos"`` (:class:`~automodel_vlm.datasets.videos.Clip`) where a row has video parts."""

    # packing cuts the samples longer than packed_sequence.max_length to it instead of leaving them out (upstream's
    # recipe-level ``truncate`` key, which the text-only chat factories take)
    truncate = False

    def __init__(self, path_or_dataset_id: str, split: str = "train", messages_column: str = "messages",
                 image_column: str | None = "image", image_root: str | None = None,
                 limit_dataset_samples: int | None = None, config_key: str = "dataset",
                 on_bad_row: OnBadRow = "error"):
        rows, folder = load_conversation_rows(path_or_dataset_id, split, f"{config_key}.path_or_dataset_id")
        self._read(rows, folder, str(path_or_dataset_id), messages_column, image_column, image_root,
                   limit_dataset_samples, config_key, on_bad_row)

    @classmethod
    def from_rows(cls, rows: Any, folder: Path | None, source: str, config_key: str = "dataset",
                  image_column: str | None = "image", limit_dataset_samples: int | None = None,
                  on_bad_row: OnBadRow = "error") -> ImageTextChatDataset:
        """The data set of already loaded rows holding a ``messages`` column (``folder``: where relative image
        paths start; ``source``: what errors name)."""
        dataset = cls.__new__(cls)
        dataset._read(rows, folder, source, "messages", image_column, None, limit_dataset_samples, config_key,
                      on_bad_row)
        return dataset

    def _read(self, rows: Any, folder: Path | None, source: str, messages_column: str, image_column: str | None,
              image_root: str | None, limit_dataset_samples: int | None, config_key: str,
              on_bad_row: OnBadRow) -> None:
        self.key = config_key
        self.source = source
        if limit_dataset_samples is not None:
            rows = rows.select(range(min(limit_dataset_samples, len(rows))))
        if messages_column not in rows.column_names:
            raise AutomodelError(f"{config_key}.messages_column: '{self.source}' has no column '{messages_column}' "
                                 f"(found: {', '.join(rows.column_names)})")
        if image_column is not None and image_column not in rows.column_names:
            if image_column == "image" and "images" in rows.column_names:
                image_column = "images"
            elif image_column != "image":
                raise AutomodelError(f"{config_key}.image_column: '{self.source}' has no column '{image_column}' "
                                     f"(found: {', '.join(rows.column_names)})")
            else:
                image_column = None  # images only inline in the messages, if any
        self.image_column = image_column
        self.image_root = Path(image_root) if image_root is not None else folder
        if image_root is not None and not self.image_root.is_dir():
            raise AutomodelError(f"{config_key}.image_root: '{image_root}' is not a folder")
        rows = _undecoded(rows, image_column)
        self.samples: list[tuple[list[dict], list[Any]]] = []
        self.videos: dict[int, list[tuple[Path, float | None]]] = {}  # a sample's clips (path, fps), if any
        self.row_indices: list[int] = []  # the row each sample came from (rows may be skipped)
        bad_rows = BadRows(on_bad_row, self.source, config_key)
        for index, row in enumerate(rows):
            try:
                prepared, clips = self._prepare(index, row, messages_column)
                if clips:
                    self.videos[len(self.samples)] = clips
                self.samples.append(prepared)
            except AutomodelError as err:
                if not bad_rows.skip:
                    raise AutomodelError(f"{err}; or set {config_key}.on_bad_row: skip to leave such rows out") \
                        from None
                bad_rows.skipped.append(str(err).removeprefix(f"{self.key}: "))
                continue
            self.row_indices.append(index)
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"{config_key}.path_or_dataset_id: '{self.source}' has no usable rows")

    # ---- reading rows ------------------------------------------------------------------------------------------

    def _where(self, index: int) -> str:
        return f"{self.key}: row {index + 1} of '{self.source}'"

    def _prepare(self, index: int, row: dict, messages_column: str
                 ) -> tuple[tuple[list[dict], list[Any]], list[tuple[Path, float | None]]]:
        messages = row[messages_column]
        if isinstance(messages, str):
            import json

            try:
                messages = json.loads(messages)
            except json.JSONDecodeError:
                raise AutomodelError(f"{self._where(index)}: column '{messages_column}' is a string, not a list of "
                                     "messages") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise AutomodelError(f"{self._where(index)}: '{messages_column}' must be a list of {{role, content}} "
                                 f"messages, found {type(messages).__name__}")
        messages = [_clean(m) for m in messages]
        if not any(m.get("role") == "assistant" for m in messages):
            roles = ", ".join(str(m.get("role")) for m in messages) or "none"
            raise AutomodelError(f"{self._where(index)}: the conversation has no assistant turn to learn from "
                                 f"(roles: {roles}); each row needs a message with role 'assistant'")
        column_images = row.get(self.image_column) if self.image_column else None
        if column_images is None:
            column_images = []
        elif not isinstance(column_images, list):
            column_images = [column_images]
        normalised, inline, image_parts, clips = [], [], 0, []
        for message in messages:
            parts = []
            for part in _parts(message.get("content")):
                if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                    image_parts += 1
                    ref = next((part[k] for k in _INLINE_KEYS if part.get(k) is not None), None)
                    if isinstance(ref, dict) and "url" in ref:  # OpenAI-style {"image_url": {"url": ...}}
                        ref = ref["url"]
                    if ref is not None:
                        inline.append(ref)
                    parts.append({"type": "image"})
                elif isinstance(part, dict) and part.get("type") == "video":
                    clips.append(self._check_video(index, part))
                    parts.append({"type": "video"})
                elif isinstance(part, dict):
                    parts.append(part)
                else:
                    parts.append({"type": "text", "text": str(part)})
            normalised.append({**message, "content": parts})
        if inline and column_images:
            raise AutomodelError(f"{self._where(index)}: images are given both inline in the messages and in column "
                                 f"'{self.image_column}'; use one")
        images = inline or column_images
        if image_parts == 0 and images:
            # No placeholder in the conversation: the images go before the first user turn's text.
            first = next((m for m in normalised if m.get("role") == "user"), normalised[0])
            first["content"] = [{"type": "image"} for _ in images] + first["content"]
            image_parts = len(images)
        if image_parts != len(images):
            raise AutomodelError(f"{self._where(index)}: {image_parts} image part(s) in the messages but "
                                 f"{len(images)} image(s) given; give one image per {{'type': 'image'}} part")
        return (normalised, [self._check_ref(index, ref) for ref in images]), clips

    def _check_video(self, index: int, part: dict) -> tuple[Path, float | None]:
        other = sorted(set(part) - {"type", "fps", *_VIDEO_KEYS})
        if other:  # upstream's frame_indices, say: nothing here would act on them
            raise AutomodelError(f"{self._where(index)}: a video part takes video (or path), fps and nothing else; "
                                 f"found {', '.join(other)} (the processor's video_processor samples the frames: "
                                 "set its fps / num_frames / max_frames)")
        ref = next((part[k] for k in _VIDEO_KEYS if part.get(k) is not None), None)
        if not isinstance(ref, str):
            raise AutomodelError(f"{self._where(index)}: a video part needs \"video\": a path to an animated GIF / "
                                 f"WebP or a folder of frame images, found {ref!r:.60}")
        if ref.startswith(("http://", "https://")):
            raise AutomodelError(f"{self._where(index)}: video '{ref}' is a URL; download it and give a local path")
        fps = part.get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
            raise AutomodelError(f"{self._where(index)}: video '{ref}': fps must be a positive number, got {fps!r}")
        path = Path(ref.removeprefix("file://"))
        if not path.is_absolute() and self.image_root is not None:
            path = self.image_root / path
        if (issue := clip_issue(path, fps)) is not None:
            raise AutomodelError(f"{self._where(index)}: {issue}")
        return path, (float(fps) if fps is not None else None)

    def open_video(self, index: int, path: Path, fps: float | None) -> Any:
        from PIL import UnidentifiedImageError

        try:
            return read_clip(path, fps)
        except (OSError, UnidentifiedImageError, ValueError) as err:
            raise AutomodelError(f"{self._where(index)}: cannot read video '{path}': {err}") from None

    def _check_ref(self, index: int, ref: Any) -> Any:
        if isinstance(ref, dict):
            if ref.get("bytes"):
                return bytes(ref["bytes"])
            ref = ref.get("path")
        if isinstance(ref, (bytes, bytearray)):
            return bytes(ref)
        if isinstance(ref, str):
            if ref.startswith(("http://", "https://")):
                raise AutomodelError(f"{self._where(index)}: image '{ref}' is a URL; download the images and "
                                     "give local paths")
            path = Path(ref.removeprefix("file://"))
            if not path.is_absolute() and self.image_root is not None:
                path = self.image_root / path
            if not path.is_file():
                raise AutomodelError(f"{self._where(index)}: image file '{ref}' not found (looked for '{path}'); "
                                     f"fix the row, or set {self.key}.image_root to the folder its paths are "
                                     "relative to")
            return path
        if hasattr(ref, "convert"):  # a PIL image already
            return ref
        raise AutomodelError(f"{self._where(index)}: cannot read an image from {type(ref).__name__} {ref!r:.60}")

    # ---- samples -----------------------------------------------------------------------------------------------

    def open_image(self, index: int, ref: Any) -> Any:
        from PIL import Image, UnidentifiedImageError

        try:
            if isinstance(ref, Path):
                with Image.open(ref) as image:
                    return image.convert("RGB")
            if isinstance(ref, bytes):
                with Image.open(io.BytesIO(ref)) as image:
                    return image.convert("RGB")
            return ref.convert("RGB")
        except (OSError, UnidentifiedImageError) as err:
            what = f"image file '{ref}'" if isinstance(ref, Path) else "its image bytes"
            raise AutomodelError(f"{self._where(index)}: cannot open {what}: {err}") from None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        messages, refs = self.samples[index]
        row = self.row_indices[index]
        sample = {"messages": messages, "images": [self.open_image(row, ref) for ref in refs]}
        if index in self.videos:
            sample["videos"] = [self.open_video(row, path, fps) for path, fps in self.videos[index]]
        return sample

    @property
    def qa_pairs(self) -> list[tuple[int, list[dict], str]]:
        """(sample, the conversation before its last assistant turn, that turn's text) for generation checks."""
        pairs = []
        for index, (messages, _) in enumerate(self.samples):
            last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
            answer = " ".join(p.get("text", "") for p in messages[last]["content"] if p.get("type") == "text")
            pairs.append((index, messages[:last], answer.strip()))
        return pairs
