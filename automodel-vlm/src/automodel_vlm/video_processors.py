"""Pillow-backed twins of the Qwen3-VL (and Qwen3.5) and Qwen2-VL (and Qwen2.5-VL) video processors.

transformers' video processors all derive from ``BaseVideoProcessor``, which does its resizing and normalising with
torchvision, and torchvision cannot be installed beside this project's pinned CPU torch. These classes stand on
transformers' backend-free ``VideoProcessorMixin`` (the call, ``from_pretrained``, saving) and its ``PilBackend``
(Pillow resizing), and do the rest with NumPy: the same frame sampling (by ``fps`` of the clip's metadata,
``num_frames``, ``min_frames`` / ``max_frames``), the same ``smart_resize`` sizes, the same flattened patch layout
of ``pixel_values_videos`` and the same ``video_grid_thw``, so the same number of video tokens and the same
timestamps in the processor's text. Pixels differ from the torchvision ones only as Pillow's resampling differs.

They take decoded clips only (frames as arrays or PIL images, with ``video_metadata`` giving each clip's ``fps``):
the data sets read GIF / WebP / frame folders with Pillow (datasets/videos.py); no video decoder is installed.
Each is named ``<torchvision class>Pil`` and saves under the torchvision class's name, so a saved processor loads
with either backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ChannelDimension,
    PILImageResampling,
    SizeDict,
    infer_channel_dimension_format,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as frame_smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_smart_resize
from transformers.processing_utils import VideosKwargs
from transformers.utils import logging
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import VideoMetadata, convert_to_rgb, make_batched_metadata, make_batched_videos

from automodel_vlm.processor import has_torchvision

logger = logging.get_logger(__name__)
# the settings a twin shares with its torchvision class (the class's own defaults, read from it)
_SHARED = ("resample", "size", "image_mean", "image_std", "do_resize", "do_rescale", "do_normalize",
           "do_convert_rgb", "patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames",
           "do_sample_frames", "cap_pixels_per_frame", "max_video_tokens", "valid_kwargs", "model_input_names",
           "num_frames", "fps")


def _twin_of(torchvision_class: type) -> Any:
    """Class decorator: the twin takes ``torchvision_class``'s defaults (read from it) and saves under its name."""
    def decorate(cls: type) -> type:
        for name in _SHARED:
            if hasattr(torchvision_class, name):
                setattr(cls, name, getattr(torchvision_class, name))
        cls.torchvision_name = torchvision_class.__name__
        return cls

    return decorate


def patchify(clip: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int
             ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``(T, C, H, W)`` -> ``(grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size**2)`` patches and the
    grid. The clip is made a whole number of temporal patches by repeating its last frame; the rows run over time,
    then over ``merge_size`` x ``merge_size`` blocks row by row, then within a block; a row holds channel, time,
    patch row, patch column (the layout the Qwen-VL vision towers read)."""
    if pad := -clip.shape[0] % temporal_patch_size:
        clip = np.concatenate([clip, np.repeat(clip[-1:], pad, axis=0)])
    frames, channels, height, width = clip.shape
    grid = (frames // temporal_patch_size, height // patch_size, width // patch_size)
    blocks = clip.reshape(grid[0], temporal_patch_size, channels, grid[1] // merge_size, merge_size, patch_size,
                          grid[2] // merge_size, merge_size, patch_size)
    # (t, tp, c, bh, mh, ph, bw, mw, pw) -> (t, bh, bw, mh, mw, c, tp, ph, pw)
    rows = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return rows.reshape(grid[0] * grid[1] * grid[2], channels * temporal_patch_size * patch_size ** 2), grid


def _export_mixin() -> None:
    """A processor checks its video processor against ``transformers.VideoProcessorMixin``, a name transformers
    does not export (it then looks in its torchvision-only video mapping, which fails without torchvision): export
    transformers' own class under it."""
    import transformers

    if not hasattr(transformers, VideoProcessorMixin.__name__):
        setattr(transformers, VideoProcessorMixin.__name__, VideoProcessorMixin)


class _QwenVideoPil(VideoProcessorMixin, PilBackend):
    """What the Qwen twins share: decoded clips in, frames sampled, each clip resized to one size, rescaled,
    normalised and patchified. A subclass gives the sampling rule and the clip's size."""

    torchvision_name: str = ""  # transformers' class of which this is the twin (its name saved)

    def __init__(self, **kwargs: Any) -> None:
        _export_mixin()
        super().__init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "video_processor_type": self.torchvision_name}

    def clip_size(self, frames: int, height: int, width: int, size: SizeDict, factor: int, temporal_factor: int,
                  cap_pixels_per_frame: bool) -> tuple[int, int]:
        raise NotImplementedError

    def get_num_of_video_patches(self, num_frames: int, height: int, width: int, videos_kwargs: Any = None) -> int:
        """How many patches a clip of this many (sampled) frames and size gives (the processor's token count)."""
        settings = {**{k: getattr(self, k) for k in ("size", "patch_size", "merge_size", "temporal_patch_size",
                                                     "cap_pixels_per_frame")}, **(videos_kwargs or {})}
        size = settings["size"] if isinstance(settings["size"], SizeDict) else SizeDict(**settings["size"])
        patch, temporal = settings["patch_size"], settings["temporal_patch_size"]
        new_height, new_width = self.clip_size(num_frames, height, width, size, patch * settings["merge_size"],
                                               temporal, bool(settings["cap_pixels_per_frame"]))
        return -(-num_frames // temporal) * (new_height // patch) * (new_width // patch)

    def _decode_and_sample_videos(self, videos: Any, video_metadata: Any, do_sample_frames: bool | None = None,
                                  sample_indices_fn: Any = None) -> tuple[list[Any], list[VideoMetadata]]:
        videos = make_batched_videos(videos)
        if any(isinstance(video, str) or (isinstance(video, (list, tuple)) and video and isinstance(video[0], str))
               for video in videos):
            raise ValueError(f"{type(self).__name__} (Pillow, no video decoder) takes decoded clips: arrays or lists "
                             "of PIL frames with video_metadata, not file names; read GIF / WebP clips or frame "
                             "folders with automodel_vlm.datasets.videos.read_clip")
        metadata = make_batched_metadata(videos, video_metadata=video_metadata)
        if not do_sample_frames:
            return videos, metadata
        sampled = []
        for video, meta in zip(videos, metadata, strict=True):
            meta.frames_indices = sample_indices_fn(metadata=meta)
            sampled.append(video[meta.frames_indices])
        return sampled, metadata

    def _prepare_input_videos(self, videos: list[Any], do_convert_rgb: bool | None = None,
                              input_data_format: Any = None, device: Any = None) -> list[np.ndarray]:
        prepared = []
        for video in videos:
            video = np.asarray(video.cpu() if hasattr(video, "cpu") else video)
            layout = input_data_format or infer_channel_dimension_format(video, num_channels=(1, 3, 4))
            if layout == ChannelDimension.LAST:
                video = video.transpose(0, 3, 1, 2)
            if do_convert_rgb:
                video = convert_to_rgb(video, input_data_format=ChannelDimension.FIRST)
            prepared.append(np.ascontiguousarray(video))
        return prepared

    def _resized(self, clip: np.ndarray, size: tuple[int, int], resample: Any) -> np.ndarray:
        if clip.shape[-2:] == size:
            return clip
        target = SizeDict(height=size[0], width=size[1])
        return np.stack([self.resize(frame, target, resample=resample) for frame in clip])

    def _preprocess(self, videos: list[np.ndarray], do_resize: bool, size: SizeDict, resample: Any,
                    do_rescale: bool, rescale_factor: float, do_normalize: bool, image_mean: Any, image_std: Any,
                    patch_size: int, temporal_patch_size: int, merge_size: int,
                    cap_pixels_per_frame: bool | None = None, return_tensors: Any = None, **kwargs: Any
                    ) -> BatchFeature:
        rows, grids = [], []
        for clip in videos:
            if do_resize:
                new = self.clip_size(clip.shape[0], *clip.shape[-2:], size=size, factor=patch_size * merge_size,
                                     temporal_factor=temporal_patch_size,
                                     cap_pixels_per_frame=bool(cap_pixels_per_frame))
                clip = self._resized(clip, new, resample)
            clip = clip.astype(np.float32)
            if do_rescale:
                clip = clip * np.float32(rescale_factor)
            if do_normalize:
                mean = np.asarray(image_mean, dtype=np.float32).reshape(1, -1, 1, 1)
                std = np.asarray(image_std, dtype=np.float32).reshape(1, -1, 1, 1)
                clip = (clip - mean) / std
            patches, grid = patchify(clip.astype(np.float32), patch_size, merge_size, temporal_patch_size)
            rows.append(patches)
            grids.append(grid)
        return BatchFeature(data={"pixel_values_videos": np.concatenate(rows).astype(np.float32),
                                  "video_grid_thw": np.array(grids, dtype=np.int64)}, tensor_type=return_tensors)


@_twin_of(Qwen3VLVideoProcessor)
class Qwen3VLVideoProcessorPil(_QwenVideoPil):
    """Qwen3-VL's (and Qwen3.5's) video processor on Pillow. Frames: ``fps`` per second of the clip (its metadata's
    fps; 24 when it has none, as transformers), at least ``min_frames`` and at most ``max_frames`` and the clip's
    own count, or exactly ``num_frames``; spread evenly (``linspace``, rounded). The size bounds the whole sampled
    volume (``size.shortest_edge`` <= T x H x W <= ``size.longest_edge``). One difference: transformers' class
    refuses a ``num_frames`` beside its default ``fps`` (2, which a setting cannot unset); here ``num_frames``
    wins, so the setting acts."""

    def sample_frames(self, metadata: VideoMetadata, num_frames: int | None = None, fps: float | None = None,
                      **kwargs: Any) -> np.ndarray:
        total = metadata.total_num_frames
        if num_frames is None and fps is None:
            fps = self.fps
        if num_frames is None and fps is not None:
            if metadata.fps is None:
                logger.warning_once("a clip without fps in its video_metadata is sampled as 24 frames per second")
                metadata.fps = 24
            num_frames = min(max(int(total / metadata.fps * fps), self.min_frames), self.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, self.min_frames), self.max_frames)
        return np.linspace(0, total - 1, num_frames).round().astype(int)

    def clip_size(self, frames: int, height: int, width: int, size: SizeDict, factor: int, temporal_factor: int,
                  cap_pixels_per_frame: bool) -> tuple[int, int]:
        if not size.shortest_edge or not size.longest_edge:
            raise ValueError(f"`size` needs 'shortest_edge' and 'longest_edge' (pixels), got {size}")
        most = size.longest_edge
        if cap_pixels_per_frame:  # each frame's share, at most max_video_tokens patches, floored
            per_frame = max(min(self.max_video_tokens * factor * factor, most // frames),
                            int(size.shortest_edge * 1.05))
            most = per_frame * frames
        return clip_smart_resize(frames, height, width, temporal_factor=temporal_factor, factor=factor,
                                 min_pixels=size.shortest_edge, max_pixels=most)


class Qwen2VLVideoKwargs(VideosKwargs, total=False):
    """Qwen2-VL's video settings (transformers' own TypedDict sits in its torchvision-only module)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int


class Qwen2VLVideoProcessorPil(_QwenVideoPil):
    """Qwen2-VL's (and Qwen2.5-VL's) video processor on Pillow, with its defaults. Frames are sampled only with
    ``do_sample_frames``: ``num_frames`` rounded to ``temporal_patch_size``, or ``fps`` per second of the clip within
    ``min_frames`` / ``max_frames`` rounded down to it; evenly strided. Each frame is sized alone
    (``size.shortest_edge`` <= H x W <= ``size.longest_edge``; ``min_pixels`` / ``max_pixels`` set them)."""

    torchvision_name = "Qwen2VLVideoProcessor"
    resample = PILImageResampling.BICUBIC
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    do_resize = do_rescale = do_normalize = do_convert_rgb = True
    patch_size = 14
    temporal_patch_size = 2
    merge_size = 2
    min_frames = 4
    max_frames = 768
    do_sample_frames = False
    cap_pixels_per_frame = None
    max_video_tokens = 128000
    valid_kwargs = Qwen2VLVideoKwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, **kwargs: Any) -> None:
        size = dict(kwargs.pop("size", None) or self.size)
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if (value := kwargs.pop(key, None)) is not None:
                size[edge] = value
        super().__init__(size=size, **kwargs)

    def _standardize_kwargs(self, size: Any = None, min_pixels: int | None = None, max_pixels: int | None = None,
                            **kwargs: Any) -> dict:
        if min_pixels is not None or max_pixels is not None:  # a call's min_pixels / max_pixels set the size
            edges = dict(size) if size is not None else {}
            edges.update({edge: value for edge, value in (("shortest_edge", min_pixels),
                                                           ("longest_edge", max_pixels)) if value is not None})
            size = SizeDict(**edges)
        return super()._standardize_kwargs(size=size, **kwargs)

    def sample_frames(self, metadata: VideoMetadata, temporal_patch_size: int | None = None,
                      min_frames: int | None = None, max_frames: int | None = None, num_frames: int | None = None,
                      fps: float | None = None, **kwargs: Any) -> np.ndarray:
        step = temporal_patch_size or self.temporal_patch_size
        least = self.min_frames if min_frames is None else min_frames
        most = self.max_frames if max_frames is None else max_frames
        total = metadata.total_num_frames
        if num_frames is not None:
            num_frames = round(num_frames / step) * step
        elif fps is not None:
            if metadata.fps is None:
                raise ValueError("sampling fps frames per second needs the clip's fps (its video_metadata)")
            most = min(most, total) // step * step
            num_frames = int(min(max(total / metadata.fps * fps, least), most, total) // step * step)
        if num_frames is None:
            return np.arange(total)
        if not 0 < num_frames <= total:
            raise ValueError(f"cannot sample {num_frames} frames from a clip of {total}; change num_frames or fps")
        import torch

        # strided as transformers strides (torch's float arange, truncated), so the same frames at the edges
        return torch.arange(0, total, total / num_frames).int().numpy()

    def clip_size(self, frames: int, height: int, width: int, size: SizeDict, factor: int, temporal_factor: int,
                  cap_pixels_per_frame: bool) -> tuple[int, int]:
        if not size.shortest_edge or not size.longest_edge:
            raise ValueError(f"`size` needs 'shortest_edge' and 'longest_edge' (pixels), got {size}")
        most = size.longest_edge
        if cap_pixels_per_frame:  # an even share of max_video_tokens over the clip, floored
            share = int(self.max_video_tokens * factor * factor * 0.9) * temporal_factor // frames
            most = max(min(most, share), int(size.shortest_edge * 1.05))
        return frame_smart_resize(height, width, factor=factor, min_pixels=size.shortest_edge, max_pixels=most)


TWINS: dict[str, type] = {cls.torchvision_name: cls for cls in (Qwen3VLVideoProcessorPil, Qwen2VLVideoProcessorPil)}


@dataclass
class PendingVideoProcessor:
    """A ``processor.video_processor`` section without a path of its own: built from the processor's path (upstream's
    rule) when the processor is loaded (:func:`automodel_vlm.processor.open_processor`)."""

    torchvision_class: str
    settings: dict[str, Any] = field(default_factory=dict)

    def build(self, path: str) -> Any:
        return video_processor(self.torchvision_class, path, **self.settings)


def video_processor(torchvision_class: str, path: str, **settings: Any) -> Any:
    """``torchvision_class.from_pretrained(path, **settings)`` where torchvision is installed, else our twin's."""
    import transformers

    if torchvision_class not in TWINS:
        raise ValueError(f"no Pillow twin of the video processor {torchvision_class or '(none named)'} at '{path}'; "
                         f"the twins here: {', '.join(TWINS)}")
    if has_torchvision():
        return getattr(transformers, torchvision_class).from_pretrained(path, **settings)
    return TWINS[torchvision_class].from_pretrained(path, **settings)


_LOADING = ("cache_dir", "revision", "token", "local_files_only", "subfolder", "trust_remote_code")


def settings_issues(torchvision_class: str, settings: dict[str, Any]) -> dict[str, str]:
    """What is wrong with a ``processor.video_processor`` section's settings: {key: message}."""
    known = sorted(TWINS[torchvision_class].valid_kwargs.__annotations__)
    issues = {key: f"{torchvision_class} has no setting '{key}' (its settings: {', '.join(known)})"
              for key in settings if key not in (*known, *_LOADING, "pretrained_model_name_or_path")}
    if settings.get("fps") is not None and settings.get("num_frames") is not None:
        issues["num_frames"] = ("give fps (frames sampled per second of the clip) or num_frames (frames per clip), "
                                "not both")
    size = settings.get("size")
    if size is not None and not (isinstance(size, dict) and {"shortest_edge", "longest_edge"} <= set(size)):
        issues["size"] = (f"{torchvision_class}'s size is {{shortest_edge, longest_edge}}: the least and most pixels "
                          f"of the sampled clip (frames x height x width), found {size!r}")
    return issues


def _builder(torchvision_class: str) -> Any:
    def build(pretrained_model_name_or_path: str | None = None, **settings: Any) -> Any:
        if issues := settings_issues(torchvision_class, settings):
            raise ValueError("; ".join(f"{key}: {message}" for key, message in issues.items()))
        if pretrained_model_name_or_path is None:
            return PendingVideoProcessor(torchvision_class, settings)
        return video_processor(torchvision_class, str(pretrained_model_name_or_path), **settings)

    build.automodel_config_issues = lambda settings: settings_issues(torchvision_class, settings)  # at validation
    build.__name__ = build.__qualname__ = f"{torchvision_class}_from_pretrained"
    build.__doc__ = (f"transformers' ``{torchvision_class}.from_pretrained`` (our Pillow twin without torchvision); "
                     "without a path of its own, the processor's path.")
    return build


qwen3_vl_video_processor = _builder("Qwen3VLVideoProcessor")
qwen2_vl_video_processor = _builder("Qwen2VLVideoProcessor")
