"""Pipeline parallelism for vision-language models: each micro-batch's first stage gets exactly its rows' media.

The core cuts the composite model along its language model (``training/parallel/pipeline_stages.py``): the first
stage holds the vision tower, the projector and the embedding and runs the composite model's own forward, merging
the image features into the embeddings; the later stages take hidden states. torch's schedule splits every tensor
along dim 0 into micro-batches, but media tensors are not per row: how a model's media map to the rows is its
*media layout*, one entry of :data:`MEDIA_LAYOUTS` (by ``model_type``). From it :func:`media_per_row` finds each
row's items, and the core's ``pipeline_media`` regroups them per row so the schedule splits them with their rows;
a model's multi-axis rope positions (Qwen2-VL's) are computed on the whole rows before the schedule, since every
stage needs them (:func:`rope_positions`). A model without an entry is refused (at validation, and when the model
is built) with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.next_token import LABEL_POSITIONS
from automodel.training.parallel.pipeline_media import MASK_PREFIX

# split along the rows as they are (packed rows: position ids and each row's token count)
PER_ROW_KEYS = ("input_ids", "attention_mask", "labels", LABEL_POSITIONS, "position_ids", "token_count")


@dataclass(frozen=True)
class MediaLayout:
    """A model's media. ``per_image`` batch keys hold one item (dim 0) per image, the images of row 0 first, then
    row 1's, ...; each image is a run of the same number of ``token`` placeholders (the config's attribute
    ``token_attributes`` name its id) in its row's token ids, which is how many images each row holds. With
    ``grid`` (Qwen-VL's ``image_grid_thw``: each image's temporal, height and width patch counts) the images differ
    in size: an image is ``t * h * w / merge**2`` placeholders (``merge``: the vision config's
    ``spatial_merge_size``), ``per_patch`` keys hold its ``t * h * w`` patches (dim 0), and the model's multi-axis
    rope positions (its ``get_rope_index``, from ``rope_only`` keys too) are computed before the schedule, which
    hands them to every stage (:func:`rope_positions`). With ``sizes`` (Mistral 3's ``image_sizes``: each image's
    height and width in pixels, the images padded to one size in ``per_image`` keys) an image is
    ``(height // d) * (width // d)`` placeholders, ``d`` the vision tower's ``patch_size`` times the config's
    ``spatial_merge_size``, as the Pixtral processor expands it and the model splits its features. With
    ``patch_positions`` (Gemma 4's ``image_position_ids``: each image's patches' grid positions, ``-1`` for the
    padding patches) an image is its real patches over the vision tower's ``pooling_kernel_size**2`` placeholders,
    as the model splits its features. ``mask_inputs`` (per row: Gemma 3's ``token_type_ids``) are what the model
    builds its attention masks from, its images' tokens attending to each other both ways: every stage gets them
    (:func:`mask_kwargs`) and builds the model's masks. ``positions_from``: where the model's forward numbers the
    positions of rows given none from this (PaliGemma: 1) rather than 0, the pipeline hands every stage those
    positions (:func:`rope_positions`), since the later stages' text model would number them from 0."""

    per_image: tuple[str, ...] = ()
    token_attributes: tuple[str, ...] = ("image_token_id", "image_token_index")
    grid: str | None = None
    per_patch: tuple[str, ...] = ()
    rope_only: tuple[str, ...] = ()
    sizes: str | None = None
    patch_positions: str | None = None
    mask_inputs: tuple[str, ...] = ()
    positions_from: int = 0

    @property
    def keys(self) -> tuple[str, ...]:
        """The batch keys the layout places."""
        return (*self.per_image, *self.sized, *self.per_patch, *self.rope_only, *self.mask_inputs)

    @property
    def sized(self) -> tuple[str, ...]:
        """The key that gives each image's size, where the images differ in size."""
        return tuple(key for key in (self.grid, self.sizes, self.patch_positions) if key)

    def image_tokens(self, batch: dict[str, torch.Tensor], config: Any) -> list[int]:
        """Each image's placeholder count, from its size (the layout's ``grid``, ``sizes`` or ``patch_positions``)."""
        if self.patch_positions is not None:
            real = (batch[self.patch_positions] != -1).all(dim=-1).sum(dim=-1)
            return (real // config.vision_config.pooling_kernel_size ** 2).tolist()
        if self.grid is not None:
            return (batch[self.grid].prod(dim=-1) // config.vision_config.spatial_merge_size ** 2).tolist()
        step = config.vision_config.patch_size * config.spatial_merge_size
        return (batch[self.sizes] // step).prod(dim=-1).tolist()

    def token_id(self, config: Any) -> int:
        for name in self.token_attributes:
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        raise AutomodelError(f"distributed.pp_size: the model's config names no image token "
                             f"({' / '.join(self.token_attributes)}), which the pipeline counts each row's images by")


# Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5 (dense and MoE): pixel_values [patches, channels x
# patch volume] of images of any size, their grids, and 3-D rope positions that every stage needs (computed before
# the schedule, from the token types). Qwen3-VL's DeepStack feature maps travel beside the hidden states to the
# stages of the layers that add them (automodel_vlm.deepstack). Images only: a batch's videos (pixel_values_videos,
# video_grid_thw, Qwen2.5-VL's second_per_grid_ts) are keys the layout does not place.
QWEN_VL = MediaLayout(grid="image_grid_thw", per_patch=("pixel_values",), rope_only=("mm_token_type_ids",))

# model_type -> its media layout. Llava: pixel_values [images, channels, height, width], every image the same
# number of <image> tokens. Mistral 3: pixel_values [images, channels, height, width] padded to the batch's largest,
# image_sizes [images, 2] each image's own (its [IMG] tokens: one per merged patch of it). Gemma 3: as Llava (each
# image mm_tokens_per_image tokens), its image tokens marked by token_type_ids, from which every stage builds the
# masks (each image's tokens attend to each other both ways). Gemma 4: pixel_values [images, patches, values] and
# image_position_ids [images, patches, 2], each image's real patches pooled into its tokens, marked by
# mm_token_type_ids. PaliGemma: as Gemma 3 (each image num_image_tokens tokens), its prefix (images and prompt,
# token_type_ids 0) attending to itself both ways, its positions numbered from 1.
MEDIA_LAYOUTS = {"llava": MediaLayout(per_image=("pixel_values",)), "qwen2_vl": QWEN_VL, "qwen2_5_vl": QWEN_VL,
                 "qwen3_vl": QWEN_VL, "qwen3_vl_moe": QWEN_VL, "qwen3_5": QWEN_VL, "qwen3_5_moe": QWEN_VL,
                 "mistral3": MediaLayout(per_image=("pixel_values",), sizes="image_sizes"),
                 "gemma3": MediaLayout(per_image=("pixel_values",), mask_inputs=("token_type_ids",)),
                 "gemma4": MediaLayout(per_image=("pixel_values",), patch_positions="image_position_ids",
                                       mask_inputs=("mm_token_type_ids",)),
                 "paligemma": MediaLayout(per_image=("pixel_values",), mask_inputs=("token_type_ids",),
                                          positions_from=1)}


def layout_issue(config: Any) -> str | None:
    """Why ``config``'s model cannot run pipelined here (None: its media layout is known)."""
    model_type = getattr(config, "model_type", None)
    if model_type in MEDIA_LAYOUTS:
        return None
    known = ", ".join(sorted(MEDIA_LAYOUTS))
    return (f"the model ({model_type}) has no media layout here: which of its image tensors belong to which rows of "
            f"a batch, so that each pipeline micro-batch's first stage gets exactly its rows' images (known: {known}); "
            "set pp_size: 1")


def pipeline_issues(cfg: Any, config: Any) -> list[ConfigIssue]:
    """What the VLM recipe cannot run with ``distributed.pp_size > 1`` (``config``: the model's Hugging Face config
    where validation can read it)."""
    why = layout_issue(config) if config is not None else None
    return [ConfigIssue("distributed.pp_size", f"{cfg.distributed.pp_size}: {why}")] if why is not None else []


def media_per_row(batch: dict[str, torch.Tensor], config: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{key: (the batch's tensor, each row's item count)}`` for the media of ``batch`` under ``config``'s layout;
    an ``AutomodelError`` for a batch key the layout does not place, or image tokens that do not count images."""
    layout = MEDIA_LAYOUTS[config.model_type]
    unplaced = [key for key in batch if key not in PER_ROW_KEYS and key not in layout.keys]
    if unplaced:
        raise AutomodelError(f"distributed.pp_size: the batch holds {', '.join(unplaced)}, which the pipeline does not "
                             f"know how to split over micro-batches for a {config.model_type} model (its media layout: "
                             f"{', '.join(layout.keys)}); set pp_size: 1")
    tokens = (batch["input_ids"] == layout.token_id(config)).sum(dim=1)
    if layout.sized:
        return _sized_media(batch, config, layout, tokens)
    present = [key for key in layout.per_image if key in batch]
    if not present:
        return {}
    images = batch[present[0]].shape[0]
    per_image = int(tokens.sum()) // images if images else 0
    if not per_image or int(tokens.sum()) % images or bool((tokens % per_image).any()):
        raise AutomodelError(f"distributed.pp_size: a batch of {images} images with {tokens.tolist()} image tokens per "
                             "row: the rows' images cannot be told apart (each image must be the same number of image "
                             "tokens); make sure the processor expands every image and no row is truncated")
    counts = tokens // per_image
    return {key: (batch[key], counts) for key in present}


def mask_kwargs(batch: dict[str, torch.Tensor], config: Any, extra: int) -> dict[str, torch.Tensor]:
    """The token types every stage builds the model's masks from (``mask_<name>``, the core's
    ``pipeline_stages``), with ``extra`` padding positions of text type (0); none for a model without them."""
    layout = MEDIA_LAYOUTS[config.model_type]
    return {MASK_PREFIX + key: torch.nn.functional.pad(batch[key], (0, extra), value=0)
            for key in layout.mask_inputs if batch.get(key) is not None}


def _sized_media(batch: dict[str, torch.Tensor], config: Any, layout: MediaLayout, tokens: torch.Tensor
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Images of any size: each row's images are the next ones in order whose placeholders add up to its image
    tokens; the sizes and the ``per_image`` keys counted by images, the ``per_patch`` keys by each image's
    ``t * h * w`` patches."""
    (sized,) = layout.sized
    if sized not in batch:
        return {}
    placeholders = layout.image_tokens(batch, config)
    patches = batch[layout.grid].prod(dim=-1) if layout.grid is not None else None
    images, rows_patches, start = [], [], 0
    for row, wanted in enumerate(tokens.tolist()):
        end, held = start, 0
        while held < wanted and end < len(placeholders):
            held, end = held + placeholders[end], end + 1
        if held != wanted:
            raise AutomodelError(f"distributed.pp_size: row {row} holds {wanted} image tokens, which its images' "
                                 f"{sized} ({batch[sized][start:end].tolist()}) do not make up; make sure the "
                                 "processor expands every image and no row is truncated")
        images.append(end - start)
        rows_patches.append(int(patches[start:end].sum()) if patches is not None else 0)
        start = end
    if start != len(placeholders):
        raise AutomodelError(f"distributed.pp_size: the batch has {len(placeholders)} images but its rows' image "
                             f"tokens place {start}; make sure no row is truncated")
    device = batch[sized].device
    counts, per_patch = torch.tensor(images, device=device), torch.tensor(rows_patches, device=device)
    return {**{key: (batch[key], counts) for key in (sized, *layout.per_image) if key in batch},
            **{key: (batch[key], per_patch) for key in layout.per_patch if key in batch}}


def rope_positions(batch: dict[str, torch.Tensor], config: Any, rope: Any) -> dict[str, torch.Tensor]:
    """``batch`` ready for the pipeline under ``config``'s layout: where the layout computes multi-axis rope
    positions (``rope``: the model's ``get_rope_index``) and the batch has images, their positions as the model's
    forward computes them from the whole rows, rows first (``[rows, axes, length]``: the schedule splits every
    tensor along dim 0; the stages take them back), without the keys read only for them; packed rows' positions
    (computed by the collator) rows first as well; a model numbering its positions from ``positions_from``
    (PaliGemma), those of rows given none."""
    layout = MEDIA_LAYOUTS[config.model_type]
    if layout.positions_from and batch.get("position_ids") is None:  # PaliGemma's, numbered from 1
        rows, length = batch["input_ids"].shape
        positions = torch.arange(length, device=batch["input_ids"].device) + layout.positions_from
        return {**batch, "position_ids": positions.expand(rows, length)}
    if not layout.rope_only:
        return batch
    kept = {key: value for key, value in batch.items() if key not in layout.rope_only}
    given = batch.get("position_ids")
    if given is not None and given.dim() == 3:  # packed rows' (PackedVLMCollator): [text + axes, rows, length]
        return {**kept, "position_ids": given.transpose(0, 1)}
    if layout.grid not in batch or given is not None:  # text only: the model's 1-D positions
        return kept
    positions, _ = rope(batch["input_ids"], image_grid_thw=batch[layout.grid],
                        attention_mask=batch.get("attention_mask"),
                        **{key: batch[key] for key in layout.rope_only if key in batch})
    return {**kept, "position_ids": positions.transpose(0, 1)}
