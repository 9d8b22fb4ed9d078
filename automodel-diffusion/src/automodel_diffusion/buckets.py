"""Aspect-ratio buckets, as upstream's image-edit loader forms them: every image keeps its aspect ratio within a pixel
budget (sides multiples of 32), and samples whose images come out the same sizes share a bucket, from which each batch
is drawn (the core's ``BucketBatchSampler``), so that its tensors stack.
"""

from __future__ import annotations

import math

ALIGN = 32  # upstream's image-edit preprocessing (and diffusers' Qwen-Image-Edit pipeline) size images in 32s


def fit_area(width: int, height: int, area: int, multiple: int = ALIGN) -> tuple[int, int]:
    """(width, height) for an image of ``width`` x ``height`` within ``area`` pixels: its aspect ratio kept as
    nearly as sides that are multiples of ``multiple`` allow (rounded down, then the longer side shortened while the
    area is over budget); never under ``multiple``."""
    scale = math.sqrt(area / (width * height))
    fitted = [max(multiple, math.floor(side * scale / multiple) * multiple) for side in (width, height)]
    while fitted[0] * fitted[1] > area and max(fitted) > multiple:
        longer = 0 if fitted[0] >= fitted[1] else 1
        fitted[longer] -= multiple
    return fitted[0], fitted[1]
