"""Media tensors (images, their patches) through a pipeline schedule that splits a batch into micro-batches.

torch's schedule splits every tensor argument along dim 0 into the micro-batches, which is right for per-row tensors
(token ids, masks) but not for media: Llava's ``pixel_values`` is ``[images, C, H, W]`` with a row holding none,
one or several images. So the domain that knows the layout regroups each media tensor *per row* before the
schedule (:func:`per_row`: ``[rows, most items of a row, ...]``, zero-padded, with each row's item count), the
schedule splits that along the rows like any per-row tensor, and the first stage takes back exactly its rows'
items in their order (:func:`model_media`). The keyword names: ``media_<name>`` (the regrouped tensor) and
``media_<name>_count`` (the rows' item counts).
"""

from __future__ import annotations

import torch

from automodel.errors import AutomodelError

PREFIX = "media_"
COUNT = "_count"
# per-row token types every stage builds the model's masks from (``pipeline_stages``), e.g. mask_token_type_ids
MASK_PREFIX = "mask_"


def per_row(items: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``items`` (dim 0: the items of row 0, then of row 1, ...) as ``[rows, max(counts), ...]``, zero-padded."""
    rows, most = counts.shape[0], int(counts.max()) if counts.numel() else 0
    grouped = items.new_zeros((rows, most, *items.shape[1:]))
    starts = torch.cumsum(counts, 0) - counts
    for row in range(rows):
        count = int(counts[row])
        grouped[row, :count] = items[int(starts[row]): int(starts[row]) + count]
    return grouped


def media_kwargs(media: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The schedule's keyword tensors for ``{name: (items, per-row counts)}``."""
    kwargs = {}
    for name, (items, counts) in media.items():
        kwargs[PREFIX + name] = per_row(items, counts)
        kwargs[PREFIX + name + COUNT] = counts
    return kwargs


def model_media(kwargs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's media keyword arguments for one micro-batch's ``media_*`` keywords: each tensor's items of these
    rows, in row order (absent where the rows have none, as in a batch of such rows)."""
    found = {}
    for key, grouped in kwargs.items():
        if not key.startswith(PREFIX):
            raise AutomodelError(f"a pipeline stage was given '{key}', which it does not take (its inputs: token ids "
                                 "or hidden states, attention_mask, position_ids, media_* and mask_* tensors)")
        if key.endswith(COUNT):
            continue
        counts = kwargs[key + COUNT]
        if int(counts.sum()) == 0:
            continue
        found[key[len(PREFIX):]] = torch.cat([grouped[row, :int(counts[row])] for row in range(counts.shape[0])])
    return found
