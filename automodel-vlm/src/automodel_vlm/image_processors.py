"""Pillow-backed twins of the Inkling, MiniMax-M3-VL, Step3.7, Kimi K2.5 and Nemotron-H Omni image processors.

transformers ships these families' image processors only on its torchvision backend (``TorchvisionBackend``),
and torchvision cannot be installed beside this project's pinned CPU torch. These classes do the same work on
transformers' ``PilBackend`` (Pillow resizing, NumPy arithmetic) and give the same outputs: the same keys, layout,
grids and patch counts, so the same number of image tokens in the processor; the pixel values differ from the
torchvision ones only as Pillow's resampling differs from torchvision's (the same holds for transformers' own
``*ImageProcessorPil`` twins). Each is named ``<torchvision class>Pil`` so that ``save_pretrained`` writes the
torchvision class's name (``PilBackend.to_dict`` strips the suffix): a saved processor loads with either backend.

The family builders (family_processors.py) use a twin only where torchvision is missing.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_transforms import divide_to_patches
from transformers.image_utils import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PILImageResampling,
    SizeDict,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ImagesKwargs


def _rescale_normalize(image: np.ndarray, backend: PilBackend, do_rescale: bool, rescale_factor: float,
                       do_normalize: bool, mean: Any, std: Any) -> np.ndarray:
    """float32 ``(image * rescale_factor - mean) / std`` over a channels-first image, each step as asked."""
    image = image.astype(np.float32)
    if do_rescale:
        image = backend.rescale(image, rescale_factor)
    if do_normalize:
        image = backend.normalize(image, mean, std)
    return image.astype(np.float32)


# ---- Inkling -------------------------------------------------------------------------------------------------------

class InklingImageProcessorKwargs(ImagesKwargs, total=False):
    """``rescale_image_frac``: the long edge is scaled by it before patching (None: not scaled);
    ``rescale_image_max_upscaled_long_edge``: a cap on that growth in pixels (an image above it stays as is)."""

    rescale_image_frac: float | None
    rescale_image_max_upscaled_long_edge: int | None


def inkling_tiles(image: np.ndarray, side: int) -> list[np.ndarray]:
    """Inkling's tiling: ``ceil(height / side)`` rows by ``width // side + 1`` columns (a width that ``side`` divides
    gets one more, empty column: the model was trained so), row by row, edge tiles cut short."""
    height, width = image.shape[-2:]
    rows, columns = -(-height // side), width // side + 1
    return [image[..., r * side:(r + 1) * side, c * side:(c + 1) * side] for r in range(rows) for c in range(columns)]


class InklingImageProcessorPil(PilBackend):
    """Inkling's image processor on Pillow: an image (optionally rescaled, LANCZOS) cut into ``size`` square tiles,
    short ones padded with -1 before rescaling and normalising; ``pixel_values`` is ``(tiles, 2, side, side, 3)``
    (each tile twice, channels last) and ``num_patches`` the tiles per image (one image token each)."""

    resample = PILImageResampling.LANCZOS
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    default_to_square = False
    do_convert_rgb = True
    do_rescale = True
    do_normalize = True
    size = {"height": 40, "width": 40}
    rescale_image_frac = None
    rescale_image_max_upscaled_long_edge = 2048
    valid_kwargs = InklingImageProcessorKwargs

    def _validate_preprocess_kwargs(self, do_resize: bool | None = None, size: SizeDict | None = None,
                                    **kwargs: Any) -> None:
        if do_resize is False:
            raise ValueError("InklingImageProcessor: do_resize cannot be false (the tiles are always of `size`)")
        if size is None or size.height != size.width:
            raise ValueError(f"InklingImageProcessor: size must be a square (height == width), got {size}")
        super()._validate_preprocess_kwargs(size=size, **kwargs)

    def _rescaled(self, image: np.ndarray, frac: float | None, cap: int | None, resample: Any) -> np.ndarray:
        if frac is None:
            return image
        height, width = image.shape[-2:]
        long_edge = max(height, width)
        target = long_edge * frac
        if cap is not None:
            target = min(target, max(cap, long_edge))
        ratio = target / long_edge
        if ratio == 1.0:
            return image
        # half-up rounding, as the model's reference
        new = SizeDict(height=math.floor(height * ratio + 0.5), width=math.floor(width * ratio + 0.5))
        return self.resize(image, new, resample=resample)

    def _preprocess(self, images: list[np.ndarray], size: SizeDict, do_rescale: bool, rescale_factor: float,
                    do_normalize: bool, image_mean: Any, image_std: Any, resample: Any,
                    rescale_image_frac: float | None, rescale_image_max_upscaled_long_edge: int | None,
                    return_tensors: Any, **kwargs: Any) -> BatchFeature:
        side = size.height
        tiles, counts = [], []
        for image in images:
            image = self._rescaled(image, rescale_image_frac, rescale_image_max_upscaled_long_edge, resample)
            own = [tile.astype(np.float32) for tile in inkling_tiles(image, side)]
            own = self.pad(own, pad_size=SizeDict(height=side, width=side), fill_value=-1.0)
            own = [_rescale_normalize(t, self, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
                   for t in own]
            tiles.extend(own)
            counts.append(len(own))
        stacked = np.stack(tiles)  # (tiles, C, side, side)
        pixel_values = np.repeat(stacked.transpose(0, 2, 3, 1)[:, None], 2, axis=1)  # (tiles, 2, side, side, C)
        return BatchFeature(data={"pixel_values": pixel_values, "num_patches": np.array(counts, dtype=np.int64)},
                            tensor_type=return_tensors)


# ---- MiniMax-M3-VL -------------------------------------------------------------------------------------------------

class MiniMaxM3VLImageProcessorPil(Qwen2VLImageProcessorPil):
    """MiniMax-M3-VL's image processor on Pillow. Its torchvision class is Qwen2-VL's (``smart_resize`` to multiples
    of ``patch_size * merge_size``, CLIP normalisation, patches flattened merge-window by merge-window, each repeated
    ``temporal_patch_size`` times) with its own default pixel range, so this is transformers' Pillow Qwen2-VL class
    with those defaults; ``image_grid_thw`` gives ``t * h * w / merge_size**2`` image tokens per image."""

    size = {"shortest_edge": 4 * 28 * 28, "longest_edge": 451584}

    def __init__(self, **kwargs: Any) -> None:
        # the official checkpoint's saved size [672, 672] was never used: the class default stands for it
        if kwargs.get("size") == [672, 672]:
            kwargs["size"] = dict(self.size)
        super().__init__(**kwargs)


# ---- Step3.7 -------------------------------------------------------------------------------------------------------

class Step3p7ImageProcessorKwargs(ImagesKwargs, total=False):
    """``patch_size``: the side of each local crop; ``max_image_size``: larger images are first scaled down."""

    patch_size: int
    max_image_size: int


class Step3p7ImageProcessorPil(PilBackend):
    """Step3.7's image processor on Pillow: per image a global view resized to ``size`` and zero or more local crops
    (a sliding window whose side follows the aspect ratio) resized to ``patch_size``; ``pixel_values`` holds the
    global views, ``pixel_values_local`` every image's crops in turn, ``num_local_patches`` their counts and
    ``patch_newline_masks`` where a row of crops ends."""

    resample = PILImageResampling.BILINEAR
    size = {"height": 728, "width": 728}
    patch_size = 504
    max_image_size = 3024
    do_rescale = True
    do_normalize = True
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    do_convert_rgb = True
    valid_kwargs = Step3p7ImageProcessorKwargs
    model_input_names = ["pixel_values", "pixel_values_local", "num_local_patches"]
    # the vision tower's patch and total downsampling stride: Step3p7Processor counts image tokens from them
    vision_patch_size = 14
    downsampler_stride = 4

    def _layout(self, width: int, height: int, image_size: int, crop: int) -> dict[str, Any]:
        """Where one image's views come from: ``square`` (a near-degenerate image, min side under 32 and aspect
        over 4, is zero-padded to a square first), ``global_wh`` (the size the global view passes through),
        ``crop_wh`` and ``window`` (the image resized to ``crop_wh`` is cut into ``window`` squares; 0: no crops)
        and ``grid`` (crops across, down)."""
        square = min(width, height) < 32 and max(width / height, height / width) > 4
        if square:
            width = height = max(width, height)
        if max(width, height) > self.max_image_size:
            scale = self.max_image_size / max(width, height)
            width, height = int(width * scale), int(height * scale)
        short, long = min(width, height), max(width, height)
        if long <= image_size:  # fits the global view: crops only for an elongated image, as wide as its short side
            window = short if long / short > 1.5 else 0
        else:
            window = min(short, crop) if long / short > 4 else crop
        if window == 0:
            return {"square": square, "global_wh": (width, height), "crop_wh": (width, height), "window": 0,
                    "grid": (0, 0)}

        def snapped(dim: int) -> int:  # to a multiple of the window: up when the rest is over a fifth of it
            if dim < window:
                return dim
            return window * (dim // window + (1 if dim % window > 0.2 * window else 0))

        crop_wh = (snapped(width), snapped(height))
        return {"square": square, "global_wh": (width, height), "crop_wh": crop_wh, "window": window,
                "grid": (max(1, crop_wh[0] // window), max(1, crop_wh[1] // window))}

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """The local crops of an image of this size."""
        images_kwargs = images_kwargs or {}
        size = images_kwargs.get("size", self.size)
        across, down = self._layout(width, height, size["height"], images_kwargs.get("patch_size",
                                                                                     self.patch_size))["grid"]
        return across * down

    def _views(self, image: np.ndarray, image_size: int, crop: int, resample: Any) -> tuple[np.ndarray, list, tuple]:
        """An image's global view (``image_size`` square, uint8) and its raw crops (``window`` square)."""
        height, width = image.shape[-2:]
        plan = self._layout(width, height, image_size, crop)
        if plan["square"]:
            side = max(width, height)
            image = self.pad([image], pad_size=SizeDict(height=side, width=side))[0]
        global_w, global_h = plan["global_wh"]
        view = self.resize(image, SizeDict(height=global_h, width=global_w), resample=resample)
        view = self.resize(view, SizeDict(height=image_size, width=image_size), resample=resample)
        if plan["window"] == 0:
            return view, [], plan["grid"]
        crop_w, crop_h = plan["crop_wh"]
        for_crops = self.resize(image, SizeDict(height=crop_h, width=crop_w), resample=resample)
        return view, divide_to_patches(for_crops, plan["window"]), plan["grid"]

    def _preprocess(self, images: list[np.ndarray], do_rescale: bool, rescale_factor: float, do_normalize: bool,
                    image_mean: Any, image_std: Any, resample: Any, size: SizeDict, patch_size: int,
                    return_tensors: Any, **kwargs: Any) -> BatchFeature:
        def finished(image: np.ndarray) -> np.ndarray:
            return _rescale_normalize(image, self, do_rescale, rescale_factor, do_normalize, image_mean, image_std)

        views, crops, counts, masks = [], [], [], []
        for image in images:
            view, raw, (across, down) = self._views(image, size.height, patch_size, resample)
            views.append(finished(view))
            crops.extend(finished(self.resize(c, SizeDict(height=patch_size, width=patch_size), resample=resample))
                         for c in raw)
            counts.append(len(raw))
            # a row of crops ends with a newline, except the last row
            masks.append([col == across - 1 and row < down - 1 for row in range(down) for col in range(across)])
        result = BatchFeature(data={"pixel_values": np.stack(views), "num_local_patches": counts},
                              tensor_type=return_tensors)
        most = max(counts, default=0)
        if most:
            # set after construction, so that the masks stay lists of bools (BatchFeature would make them tensors)
            result["pixel_values_local"] = BatchFeature({"v": np.stack(crops)}, tensor_type=return_tensors)["v"]
            result["patch_newline_masks"] = [mask + [False] * (most - len(mask)) for mask in masks]
        return result


# ---- Kimi K2.5 -----------------------------------------------------------------------------------------------------

class KimiK25ImageProcessorKwargs(ImagesKwargs, total=False):
    """``max_patches``: the most vision patches an image may give (larger ones are scaled down); ``patch_size``: the
    vision tower's patch side; ``merge_size``: the side of the square of patches merged into one image token."""

    max_patches: int
    patch_size: int
    merge_size: int


def kimi_k25_sizes(height: int, width: int, patch_size: int, merge_size: int, max_patches: int,
                   max_side_patches: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Kimi K2.5's image sizing: ((resized height, width), (padded height, width)). The image is only ever scaled
    down (one factor for both sides), so that it gives at most ``max_patches`` patches and at most
    ``max_side_patches`` patches along a side, then zero-padded at the bottom and right to multiples of
    ``patch_size * merge_size``."""
    rows, columns = max(1, height // patch_size), max(1, width // patch_size)
    limit = max_side_patches * patch_size
    scale = min(1.0, math.sqrt(max_patches / (rows * columns)), limit / height, limit / width)
    new_height = min(max(1, int(height * scale)), limit)
    new_width = min(max(1, int(width * scale)), limit)
    block = patch_size * merge_size
    return (new_height, new_width), (-(-new_height // block) * block, -(-new_width // block) * block)


class Kimi_K25ImageProcessorPil(PilBackend):
    """Kimi K2.5's image processor on Pillow: each image scaled down (bicubic) within ``max_patches`` patches and
    ``size["max_height"]`` patches a side (:func:`kimi_k25_sizes`), zero-padded to whole merge windows, rescaled and
    normalised, then cut into ``patch_size`` squares row by row; ``pixel_values`` is ``(patches, C, patch, patch)``
    over all images and ``image_grid_thw`` ``[1, rows, columns]`` per image (``rows * columns / merge_size**2``
    image tokens)."""

    resample = PILImageResampling.BICUBIC
    size = {"max_height": 512, "max_width": 512}
    max_patches = 16384
    do_resize = True
    do_rescale = True
    do_normalize = True
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    do_convert_rgb = True
    patch_size = 14
    merge_size = 2
    valid_kwargs = KimiK25ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]

    def _validate_preprocess_kwargs(self, size: SizeDict | None = None, **kwargs: Any) -> None:
        if size is not None and (size.max_height is None or size.max_height != size.max_width):
            raise ValueError(f"Kimi_K25ImageProcessor: size must be {{max_height: N, max_width: N}} (one limit for "
                             f"both sides), got {size}")
        super()._validate_preprocess_kwargs(size=size, **kwargs)

    def _sizes(self, height: int, width: int, images_kwargs: dict | None = None) -> tuple[tuple, tuple]:
        given = images_kwargs or {}
        side = given["size"]["max_height"] if "size" in given else self.size["max_height"]
        return kimi_k25_sizes(height, width, given.get("patch_size", self.patch_size),
                              given.get("merge_size", self.merge_size), given.get("max_patches", self.max_patches),
                              side)

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """The vision patches of an image of this size (``/ merge_size**2`` image tokens)."""
        padded_height, padded_width = self._sizes(height, width, images_kwargs)[1]
        patch = (images_kwargs or {}).get("patch_size", self.patch_size)
        return (padded_height // patch) * (padded_width // patch)

    def _preprocess(self, images: list[np.ndarray], do_resize: bool, size: SizeDict, resample: Any,
                    do_rescale: bool, rescale_factor: float, do_normalize: bool, image_mean: Any, image_std: Any,
                    patch_size: int, merge_size: int, max_patches: int, return_tensors: Any,
                    **kwargs: Any) -> BatchFeature:
        patches, grids = [], []
        for image in images:
            if do_resize:
                (height, width), (padded_height, padded_width) = kimi_k25_sizes(
                    *image.shape[-2:], patch_size, merge_size, max_patches, size.max_height)
                image = self.resize(image, SizeDict(height=height, width=width), resample=resample)
                image = self.pad([image], pad_size=SizeDict(height=padded_height, width=padded_width))[0]
            image = _rescale_normalize(image, self, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
            channels, height, width = image.shape
            rows, columns = height // patch_size, width // patch_size
            cut = image[:, :rows * patch_size, :columns * patch_size]
            cut = cut.reshape(channels, rows, patch_size, columns, patch_size).transpose(1, 3, 0, 2, 4)
            patches.append(cut.reshape(rows * columns, channels, patch_size, patch_size))
            grids.append([1, rows, columns])
        return BatchFeature(data={"pixel_values": np.concatenate(patches),
                                  "image_grid_thw": np.array(grids, dtype=np.int64)}, tensor_type=return_tensors)


# ---- Nemotron-H Omni -----------------------------------------------------------------------------------------------

class NemotronHOmniImageProcessorKwargs(ImagesKwargs, total=False):
    """``patch_size``: the vision tower's patch side; ``downsample_ratio``: the model's pixel shuffle (a grid side is
    a multiple of its reciprocal); ``min_num_patches`` / ``max_num_patches`` (0: no cap): an image's patch count
    bounds; ``max_model_len``: the context length, which caps the patch budget of one call's images."""

    patch_size: int
    downsample_ratio: float
    min_num_patches: int
    max_num_patches: int
    max_model_len: int


def nemotron_omni_grid(height: int, width: int, patch: int, merge: int, low: int, high: int) -> tuple[int, int]:
    """The (rows, columns) patch grid an image is resized to: its own grid (``round(side / patch + 0.5)``
    per side) scaled down to at most ``high`` patches, up to at least ``low``, then each side made a multiple of
    ``merge`` (rounded up while within ``high``, else down, never below ``merge``)."""
    # Python's round (ties to even), as transformers' class rounds
    rows, cols = round(height / patch + 0.5), round(width / patch + 0.5)
    shrink = min(math.sqrt(high / (rows * cols)), 1.0)
    rows, cols = math.floor(shrink * rows), math.floor(shrink * cols)
    if high > low and rows * cols < low:
        grow = math.sqrt(low / (rows * cols))
        rows, cols = math.ceil(grow * rows), math.ceil(grow * cols)
    if rows % merge:
        up = rows + merge - rows % merge
        rows = up if up * cols <= high else max(merge, rows - rows % merge)
    if cols % merge:
        up = cols + merge - cols % merge
        cols = up if rows * up <= high else max(merge, cols - cols % merge)
    return rows, cols


class NemotronH_Omni_Reasoning_V3ImageProcessorPil(PilBackend):
    """Nemotron-H Omni's (RADIO) image processor on Pillow: each image resized (bicubic) to a patch grid near its
    own, scaled into the call's patch budget (``[min_num_patches, max_num_patches]``, capped by ``max_model_len``) and
    rounded to multiples of the merge size (``1 / downsample_ratio``); ``pixel_values`` is every image's
    ``patch_size`` patches, row by row, concatenated (``(patches, channels * patch_size**2)``, channel-major) and
    ``image_grid_hw`` each image's grid (:func:`nemotron_omni_grid`)."""

    resample = PILImageResampling.BICUBIC
    do_rescale = True
    do_normalize = True
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    do_convert_rgb = True
    patch_size = 16
    downsample_ratio = 0.5
    min_num_patches = 1024
    max_num_patches = 13312
    max_model_len = 16384
    valid_kwargs = NemotronHOmniImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_hw"]

    def __init__(self, **kwargs: Any) -> None:
        # released checkpoints name the normalisation statistics norm_mean / norm_std (as transformers' class reads)
        for legacy, name in (("norm_mean", "image_mean"), ("norm_std", "image_std")):
            if (value := kwargs.pop(legacy, None)) is not None:
                kwargs.setdefault(name, value)
        kwargs.pop("_downsample_factor", None)
        super().__init__(**kwargs)

    def _preprocess(self, images: list[np.ndarray], resample: Any, do_rescale: bool, rescale_factor: float,
                    do_normalize: bool, image_mean: Any, image_std: Any, patch_size: int, downsample_ratio: float,
                    min_num_patches: int, max_num_patches: int, max_model_len: int, return_tensors: Any = None,
                    **kwargs: Any) -> BatchFeature:
        merge = round(1 / downsample_ratio)
        budget = max((max_model_len - 4) * merge**2, min_num_patches * len(images))
        if max_num_patches:
            budget = min(budget, max_num_patches)
        budget = max(budget, min_num_patches)
        patches, grids = [], []
        for image in images:  # channels first
            height, width = image.shape[-2:]
            grid_h, grid_w = nemotron_omni_grid(height, width, patch_size, merge, min_num_patches, budget)
            if (height, width) != (grid_h * patch_size, grid_w * patch_size):
                image = self.resize(image, SizeDict(height=grid_h * patch_size, width=grid_w * patch_size),
                                    resample=resample)
            image = _rescale_normalize(image, self, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
            channels = image.shape[0]
            tiles = image.reshape(channels, grid_h, patch_size, grid_w, patch_size).transpose(1, 3, 0, 2, 4)
            patches.append(tiles.reshape(grid_h * grid_w, channels * patch_size**2))
            grids.append([grid_h, grid_w])
        return BatchFeature(data={"pixel_values": np.concatenate(patches),
                                  "image_grid_hw": np.array(grids, dtype=np.int64)}, tensor_type=return_tensors)


__all__ = ["InklingImageProcessorPil", "Kimi_K25ImageProcessorPil", "MiniMaxM3VLImageProcessorPil",
           "NemotronH_Omni_Reasoning_V3ImageProcessorPil", "Step3p7ImageProcessorPil", "inkling_tiles",
           "kimi_k25_sizes", "nemotron_omni_grid"]
