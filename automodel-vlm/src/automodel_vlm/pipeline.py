"""Pipeline parallelism for vision-language models: each micro-batch's first stage gets exactly its rows' media.

The core cuts the composite model along its language model (``training/parallel/pipeline_stages.py``): the first
stage holds the vision tower, the projector and the embedding and runs the composite model's own forward, merging
the image features into the embeddings; the later stages take hidden states. torch's schedule splits every tensor
along dim 0 into micro-batches, but media tensors are not per row: how a model's media map to the rows is its
*media layout*, one entry of :data:`MEDIA_LAYOUTS` (by ``model_type``). From it :func:`media_per_row` finds each
row's items, and the core's ``pipeline_media`` regroups them per row so the schedule splits them with their rows.
A model without an entry is refused (at validation, and when the model is built) with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.next_token import LABEL_POSITIONS

# split along the rows as they are (packed rows: position ids and each row's token count)
PER_ROW_KEYS = ("input_ids", "attention_mask", "labels", LABEL_POSITIONS, "position_ids", "token_count")


@dataclass(frozen=True)
class MediaLayout:
    """A model's media: ``per_image`` batch keys hold one item (dim 0) per image, the images of row 0 first, then
    row 1's, ...; each image is a run of the same number of ``token`` placeholders (the config's attribute
    ``token_attributes`` name its id) in its row's token ids, which is how many images each row holds."""

    per_image: tuple[str, ...]
    token_attributes: tuple[str, ...] = ("image_token_id", "image_token_index")

    def token_id(self, config: Any) -> int:
        for name in self.token_attributes:
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        raise AutomodelError(f"distributed.pp_size: the model's config names no image token "
                             f"({' / '.join(self.token_attributes)}), which the pipeline counts each row's images by")


# model_type -> its media layout. Llava: pixel_values [images, channels, height, width], every image the same
# number of <image> tokens. Layouts whose later stages need more than hidden states (Qwen-VL's 3-D rope positions,
# computed from the image grid in the first stage) need more than an entry here.
MEDIA_LAYOUTS = {"llava": MediaLayout(per_image=("pixel_values",))}


def layout_issue(config: Any) -> str | None:
    """Why ``config``'s model cannot run pipelined here (None: its media layout is known)."""
    model_type = getattr(config, "model_type", None)
    if model_type in MEDIA_LAYOUTS:
        return None
    return (f"the model ({model_type}) has no media layout here: which of its image tensors belong to which rows of "
            "a batch, so that each pipeline micro-batch's first stage gets exactly its rows' images (known: "
            f"{', '.join(sorted(MEDIA_LAYOUTS))}); set pp_size: 1")


def pipeline_issues(cfg: Any, config: Any) -> list[ConfigIssue]:
    """What the VLM recipe cannot run with ``distributed.pp_size > 1`` (``config``: the model's Hugging Face config
    where validation can read it)."""
    why = layout_issue(config) if config is not None else None
    return [ConfigIssue("distributed.pp_size", f"{cfg.distributed.pp_size}: {why}")] if why is not None else []


def media_per_row(batch: dict[str, torch.Tensor], config: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{key: (the batch's tensor, each row's item count)}`` for the media of ``batch`` under ``config``'s layout;
    an ``AutomodelError`` for a batch key the layout does not place, or image tokens that do not count images."""
    layout = MEDIA_LAYOUTS[config.model_type]
    unplaced = [key for key in batch if key not in PER_ROW_KEYS and key not in layout.per_image]
    if unplaced:
        raise AutomodelError(f"distributed.pp_size: the batch holds {', '.join(unplaced)}, which the pipeline does not "
                             f"know how to split over micro-batches for a {config.model_type} model (its media layout: "
                             f"{', '.join(layout.per_image)}); set pp_size: 1")
    present = [key for key in layout.per_image if key in batch]
    if not present:
        return {}
    tokens = (batch["input_ids"] == layout.token_id(config)).sum(dim=1)
    images = batch[present[0]].shape[0]
    per_image = int(tokens.sum()) // images if images else 0
    if not per_image or int(tokens.sum()) % images or bool((tokens % per_image).any()):
        raise AutomodelError(f"distributed.pp_size: a batch of {images} images with {tokens.tolist()} image tokens per "
                             "row: the rows' images cannot be told apart (each image must be the same number of image "
                             "tokens); make sure the processor expands every image and no row is truncated")
    counts = tokens // per_image
    return {key: (batch[key], counts) for key in present}
