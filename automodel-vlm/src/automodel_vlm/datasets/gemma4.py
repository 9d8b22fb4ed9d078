"""Gemma 4's thinking-channel prefix: inserted after every model turn marker before labels are built.

Gemma 4's instruction-tuned models open every answer with an (empty) thinking channel: after the model turn marker
``<|turn>model\\n`` they emit ``<|channel>thought\\n<channel|>`` and only then the answer. Training text without it
asks the model to put the answer where it expects ``<|channel>``, which inflates the loss (upstream reports an
initial loss near 9 instead of near 3). Here the prefix's token ids go into ``input_ids`` after each marker
(attention 1, multimodal token type 0), in the rows as the processor returned them, before labels are built: the
inserted tokens are context the model sees, never labels (-100); the answer after them keeps its labels.

A tokenizer without Gemma 4's turn and channel tokens gets nothing inserted (the collation is the default one).
With ``max_length`` the rows are cut after the insertion, on the text-token axis only (media tensors are indexed by
patch, never by token), and never through image tokens: that would leave image features with no place to go.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel_vlm.datasets.collate import Rendered, VLMCollator, placeholder_ids

MODEL_TURN = "<|turn>model\n"
THINKING_PREFIX = "<|channel>thought\n<channel|>"
# Gemma 4's own tokens these strings need as single tokens; without them there is nothing to insert.
SPECIAL_TOKENS = ("<|turn>", "<|channel>", "<channel|>")
# The batch entries indexed by text token on axis 1, with the value inserted tokens get; padding is 0 but for
# input_ids (the tokenizer's pad id). Anything else (pixel values, image positions) is indexed by patch.
TOKEN_AXIS = {"input_ids": None, "attention_mask": 1, "token_type_ids": 0, "mm_token_type_ids": 0}


def thinking_prefix_ids(tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """(the model turn marker's ids, the prefix's ids), or None for a tokenizer without Gemma 4's tokens."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for token in SPECIAL_TOKENS:
        ids = encode(token)
        if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
            return None
    return encode(MODEL_TURN), encode(THINKING_PREFIX)


def marker_ends(ids: list[int], marker: list[int]) -> list[int]:
    """The positions just after each occurrence of ``marker`` in ``ids``."""
    ends, i, n = [], 0, len(marker)
    while i + n <= len(ids):
        if ids[i:i + n] == marker:
            ends.append(i + n)
            i += n
        else:
            i += 1
    return ends


def insert_at(values: list, positions: list[int], inserted: list) -> list:
    """``values`` with ``inserted`` placed before each of ``positions`` (ascending)."""
    out, previous = [], 0
    for position in positions:
        out += values[previous:position] + inserted
        previous = position
    return out + values[previous:]


class _Injector:
    """Inserts the prefix into a processor's batch (rows re-padded on the tokenizer's side) and cuts rows to
    ``max_length``, refusing a cut through the tokens in ``placeholders`` (images)."""

    def __init__(self, tokenizer: Any, marker: list[int], prefix: list[int], max_length: int | None = None,
                 placeholders: set[int] | None = None, pad_to_multiple_of: int | None = None):
        self.marker, self.prefix, self.max_length = marker, prefix, max_length
        self.multiple = pad_to_multiple_of
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.left = getattr(tokenizer, "padding_side", "right") == "left"
        self.placeholders = placeholders or set()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        input_ids = batch["input_ids"]
        attention = batch.setdefault("attention_mask", torch.ones_like(input_ids))  # padding is added below
        keys = [k for k in TOKEN_AXIS if isinstance(batch.get(k), torch.Tensor) and batch[k].shape == input_ids.shape]
        rows: dict[str, list[list[int]]] = {k: [] for k in keys}
        for row in range(input_ids.shape[0]):
            real = attention[row].nonzero().flatten()  # left or right padding alike
            ends = marker_ends(input_ids[row, real].tolist(), self.marker)
            for key in keys:
                fill = self.prefix if key == "input_ids" else [TOKEN_AXIS[key]] * len(self.prefix)
                rows[key].append(insert_at(batch[key][row, real].tolist(), ends, fill))
        self._cut(rows)
        width = self.max_length or max(len(r) for r in rows["input_ids"])
        if self.max_length is None and self.multiple:  # context parallelism's 2 x cp_size chunks
            width = -(-width // self.multiple) * self.multiple
        for key in keys:
            pad = self.pad_id if key == "input_ids" else 0
            padded = [[pad] * (width - len(r)) + r if self.left else r + [pad] * (width - len(r)) for r in rows[key]]
            batch[key] = torch.tensor(padded, dtype=batch[key].dtype, device=batch[key].device)
        return batch

    def _cut(self, rows: dict[str, list[list[int]]]) -> None:
        if self.max_length is None:
            return
        for row, ids in enumerate(rows["input_ids"]):
            media = rows["mm_token_type_ids"][row][self.max_length:] if "mm_token_type_ids" in rows else []
            if any(t in self.placeholders for t in ids[self.max_length:]) or any(media):
                raise AutomodelError(f"collate_fn.max_length: {self.max_length} cuts through the image tokens of a "
                                     f"sample ({len(ids)} tokens with Gemma 4's thinking prefix); raise max_length "
                                     "above the longest sample's tokens up to its last image")
            for key in rows:
                rows[key][row] = rows[key][row][:self.max_length]


def inject_thinking_prefix(batch: dict[str, Any], processor: Any) -> dict[str, Any]:
    """Upstream's post-tokenize hook ``(batch, processor) -> batch``: the prefix inserted after every model turn
    marker of ``batch["input_ids"]`` (attention mask and token types extended, rows re-padded). Labels built from
    the result must leave the inserted tokens out; Gemma4PrefixCollator does."""
    tokenizer = getattr(processor, "tokenizer", processor)
    found = thinking_prefix_ids(tokenizer)
    if found is None:
        return batch
    return _Injector(tokenizer, *found)(batch)


class Gemma4PrefixCollator(VLMCollator):
    """VLMCollator for Gemma 4: the thinking-channel prefix inserted after every model turn marker, unlabelled.

    ``max_length``: rows are cut to it after the insertion (never through image tokens) and padded to it.
    ``pad_to_multiple_of`` (without ``max_length``): the longest row, prefix included, is rounded up to a multiple
    of it (context parallelism's 2 x cp_size chunks), as in :class:`VLMCollator`.
    """

    def __init__(self, processor: Any, max_length: int | None = None, pad_to_multiple_of: int | None = None):
        super().__init__(processor, max_length, pad_to_multiple_of=pad_to_multiple_of)
        tokenizer = processor.tokenizer
        found = thinking_prefix_ids(tokenizer)
        self.injector = None
        if found is None:
            warnings.warn(f"collate_fn: the processor's tokenizer has no Gemma 4 turn and channel tokens "
                          f"({', '.join(SPECIAL_TOKENS)}): no thinking prefix is inserted, the collation is the "
                          "default one", stacklevel=2)
        else:
            self.injector = _Injector(tokenizer, *found, max_length=max_length,
                                      placeholders=placeholder_ids(processor), pad_to_multiple_of=pad_to_multiple_of)

    def _padding(self) -> dict[str, Any]:
        # rows are cut and padded to max_length after the insertion, where image tokens can be told apart
        return {"padding": True} if self.injector is not None else super()._padding()

    def _tokenized(self, batch: dict[str, Any], rendered: list[Rendered]) -> tuple[dict[str, Any], list[Rendered]]:
        if self.injector is None:
            return batch, rendered
        batch = self.injector(batch)
        prefix = self.injector.prefix
        edited = []
        for text, ids, mask in rendered:  # the same insertion, unmasked: the prefix is never a label
            ends = marker_ends(ids, self.injector.marker)
            edited.append((text, insert_at(ids, ends, prefix), insert_at(mask, ends, [False] * len(prefix))))
        return batch, edited
