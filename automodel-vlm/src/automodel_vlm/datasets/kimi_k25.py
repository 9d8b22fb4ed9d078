"""Kimi K2.5's collation (upstream's ``kimi_k25_vl_collate_fn``) over transformers' ``Kimi_K25Processor``.

transformers' processor already writes one ``<|media_pad|>`` per merged patch of each image (upstream's collate
expanded the remote-code processor's single placeholder itself), so the general collation serves, with one
difference upstream has: a row longer than ``max_length`` is cut there even where that cuts into an image. The
image is then left out of the batch (its pixels and grid row) and the image tokens that remain are turned into
padding, masked out, as upstream's collate does; transformers' processor would refuse the cut instead.
"""

from __future__ import annotations

from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel_vlm.datasets.collate import Rendered, VLMCollator

KEY = "dataloader.collate_fn"


class KimiK25Collator(VLMCollator):
    """``collate(samples)`` for Kimi K2.5 (transformers' ``Kimi_K25Processor``); ``max_length``, ``drop_overlong``
    and ``pad_to_multiple_of`` as in :class:`VLMCollator`, except that a row cut at ``max_length`` inside an image
    loses that row's images (upstream's behaviour) instead of failing."""

    def __init__(self, processor: Any, max_length: int | None = None, drop_overlong: bool = False,
                 pad_to_multiple_of: int | None = None):
        from transformers import Kimi_K25Processor

        if not isinstance(processor, Kimi_K25Processor):
            raise AutomodelError(f"{KEY}: kimi_k25_vl_collate_fn collates for Kimi K2.5's processor "
                                 f"(transformers' Kimi_K25Processor), but the processor is "
                                 f"{type(processor).__name__}; use default_collate_fn for other models")
        super().__init__(processor, max_length=max_length, drop_overlong=drop_overlong,
                         pad_to_multiple_of=pad_to_multiple_of)

    def _process(self, rendered: list[Rendered], images: list[list[Any]], videos: list[list[Any]] | None = None,
                 **settings: Any) -> dict[str, Any]:
        if not settings.get("truncation"):
            return super()._process(rendered, images, videos, **settings)
        batch = super()._process(rendered, images, videos, padding=True)
        return self._cut(batch, [len(group) for group in images], settings["max_length"])

    def _tokens_per_image(self, grid: torch.Tensor) -> list[int]:
        merge = self.processor.image_processor.merge_size ** 2
        return [int(row.prod()) // merge for row in grid]

    def _cut(self, batch: dict[str, Any], per_row: list[int], length: int) -> dict[str, Any]:
        """Every row cut or padded to ``length``; a row whose image tokens were cut loses its images."""
        tokenizer = self.processor.tokenizer
        image_id, pad_id = self.processor.image_token_id, tokenizer.pad_token_id
        ids, attention = batch["input_ids"], batch["attention_mask"]
        grid = batch.get("image_grid_thw")
        tokens = self._tokens_per_image(grid) if grid is not None else []
        patches = [int(row.prod()) for row in grid] if grid is not None else []
        out_ids = torch.full((ids.shape[0], length), pad_id, dtype=ids.dtype)
        out_attention = torch.zeros((ids.shape[0], length), dtype=attention.dtype)
        keep: list[bool] = []
        first = 0
        for row, count in enumerate(per_row):
            real = ids[row, attention[row].bool()][:length]
            mask = torch.ones_like(real, dtype=attention.dtype)
            whole = int((real == image_id).sum()) == sum(tokens[first:first + count])
            if not whole:  # the images of this row are dropped: their remaining tokens become masked padding
                mask[real == image_id] = 0
                real = real.masked_fill(real == image_id, pad_id)
            keep += [whole] * count
            first += count
            where = slice(0, len(real)) if tokenizer.padding_side == "right" else slice(length - len(real), length)
            out_ids[row, where], out_attention[row, where] = real, mask
        result = {**batch, "input_ids": out_ids, "attention_mask": out_attention}
        if grid is not None:
            starts = [sum(patches[:i]) for i in range(len(patches))]
            rows = [torch.arange(s, s + n) for s, n, k in zip(starts, patches, keep, strict=True) if k]
            if rows:
                result["pixel_values"] = batch["pixel_values"][torch.cat(rows)]
                result["image_grid_thw"] = grid[torch.tensor(keep)]
            else:
                del result["pixel_values"], result["image_grid_thw"]
        return result
