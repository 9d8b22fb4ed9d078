"""Collation: the processor renders, tokenises and batches conversations with their images; labels keep only the
assistant turns.

Which tokens are the assistant's is found on the conversation as the chat template renders it, before the
processor expands image placeholders (one ``<image>`` becomes one token per image patch): each assistant turn
spans from the render up to it with the generation prompt to the render through it, as in the LLM domain. Those
token positions are then carried over to the processor's ``input_ids``, which differ only by the expanded
placeholders (runs of image tokens; a general sequence alignment handles processors that insert other tokens).
"""

from __future__ import annotations

import difflib
from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel.training.collate import pad_collate
from automodel.training.loss import IGNORE_INDEX

# A conversation as assistant_mask returns it: (rendered text, its token ids, which ids are the assistant's).
Rendered = tuple[str, list[int], list[bool]]


def render(processor: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_mask(processor: Any, messages: list[dict]) -> Rendered:
    """(rendered text, its token ids before image expansion, which of them belong to assistant turns)."""
    tokenizer = processor.tokenizer

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    text = render(processor, messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = count(render(processor, messages[:i], generation_prompt=True))
        end = count(render(processor, messages[: i + 1]))
        mask[start:end] = [True] * (end - start)
    return text, ids, mask


def placeholder_ids(processor: Any) -> set[int]:
    ids = set()
    for name in ("image_token_id", "video_token_id"):
        value = getattr(processor, name, None)
        if isinstance(value, int):
            ids.add(value)
    return ids


def carry_labels(ids: list[int], mask: list[bool], expanded: list[int], placeholders: set[int]) -> list[int]:
    """Labels over ``expanded`` (the processor's ids): the token where ``mask`` marks the matching token of ``ids``,
    -100 elsewhere. Placeholder runs (never labels) may differ in length between the two."""
    labels = [IGNORE_INDEX] * len(expanded)
    i = j = 0
    while i < len(ids) and j < len(expanded):
        if ids[i] in placeholders and expanded[j] in placeholders:
            while i < len(ids) and ids[i] in placeholders:
                i += 1
            while j < len(expanded) and expanded[j] in placeholders:
                j += 1
        elif ids[i] == expanded[j]:
            if mask[i]:
                labels[j] = expanded[j]
            i += 1
            j += 1
        else:
            break
    if i == len(ids) and j == len(expanded):
        return labels
    # The processor changed more than placeholder runs: align the two sequences in general.
    labels = [IGNORE_INDEX] * len(expanded)
    matcher = difflib.SequenceMatcher(None, ids, expanded, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            if mask[a + k] and expanded[b + k] not in placeholders:
                labels[b + k] = expanded[b + k]
    return labels


class VLMCollator:
    """``collate(samples) -> {input_ids, attention_mask, pixel_values, ..., labels}`` for ``{messages, images}``
    samples (and ``videos``: clips with their frame rates); what else the processor returns (``image_sizes``,
    ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``) passes through to the model. Samples that are
    token lists already (``{input_ids, labels}``, an LLM chat data set's: text only) are padded as they are.

    ``max_length``: every row is padded to it and longer ones are truncated (upstream's collate); with
    ``drop_overlong`` the samples longer than it are left out of the batch instead. ``pad_to_multiple_of``: the
    longest row's length is rounded up to a multiple of it (context parallelism's 2 x cp_size chunks).
    """

    def __init__(self, processor: Any, max_length: int | None = None, drop_overlong: bool = False,
                 pad_to_multiple_of: int | None = None):
        if drop_overlong and max_length is None:
            raise AutomodelError("collate_fn.drop_overlong: needs max_length (the length samples are measured by)")
        self.processor = processor
        self.placeholders = placeholder_ids(processor)
        self.max_length, self.drop_overlong = max_length, drop_overlong
        self.pad_to_multiple_of = pad_to_multiple_of

    def _process(self, rendered: list[Rendered], images: list[list[Any]], videos: list[list[Any]] | None = None,
                 **settings: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(settings)
        if any(images):
            kwargs["images"] = images if all(images) else [im for group in images for im in group]
        clips = [clip for group in videos or [] for clip in group]
        if clips:  # whole clips with their frame rates: the video processor samples their frames
            if not hasattr(self.processor, "video_processor"):
                raise AutomodelError(f"dataset: the samples hold videos but {type(self.processor).__name__} takes "
                                     "none; use a model and processor with video inputs (Qwen3-VL, Qwen3.5)")
            kwargs["videos"] = [clip.frames for clip in clips]
            kwargs["video_metadata"] = [clip.metadata for clip in clips]
        return dict(self.processor(text=[text for text, _, _ in rendered], return_tensors="pt",
                                   add_special_tokens=False, **kwargs))

    def _fits(self, rendered: Rendered, images: list[Any], videos: list[Any]) -> bool:
        return self._process([rendered], [images], [videos], padding=False)["input_ids"].shape[1] <= self.max_length

    def _padding(self) -> dict[str, Any]:
        if self.max_length is None:
            multiple = {"pad_to_multiple_of": self.pad_to_multiple_of} if self.pad_to_multiple_of else {}
            return {"padding": True, **multiple}
        return {"padding": "max_length", "truncation": not self.drop_overlong, "max_length": self.max_length}

    def _tokenized(self, batch: dict[str, Any], rendered: list[Rendered]) -> tuple[dict[str, Any], list[Rendered]]:
        """The processor's batch and the rendered conversations before labels are built: a subclass may edit both
        alike (tokens inserted in a row's ``input_ids`` inserted in its rendered ids too, unmasked, stay unlabelled)."""
        return batch, rendered

    def _rendered(self, samples: list[dict[str, Any]]) -> list[Rendered]:
        """Each sample's conversation rendered, tokenised and its assistant tokens marked (:func:`assistant_mask`)."""
        return [assistant_mask(self.processor, s["messages"]) for s in samples]

    def _all_overlong(self) -> AutomodelError:
        return AutomodelError(f"collate_fn: every sample of this batch is longer than max_length ({self.max_length}) "
                              "and drop_overlong is true; raise max_length")

    def _token_rows(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Samples that are token lists already (an LLM chat data set's ``input_ids`` / ``labels``: text only),
        right-padded with the tokenizer's pad id; ``max_length`` truncates (or, ``drop_overlong``, leaves out) the
        longer ones and pads every row to it."""
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        pad = getattr(tokenizer, "pad_token_id", None)
        if self.max_length is not None:
            length = self.max_length
            if self.drop_overlong:
                samples = [s for s in samples if len(s["input_ids"]) <= length]
                if not samples:
                    raise self._all_overlong()
            samples = [{k: v[:length] if isinstance(v, (list, tuple)) else v for k, v in s.items()} for s in samples]
        return pad_collate(samples, pad_token_id=pad if pad is not None else 0,
                           pad_to_multiple_of=self.max_length or self.pad_to_multiple_of)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if samples and "messages" not in samples[0] and "input_ids" in samples[0]:
            return self._token_rows(samples)
        rendered = self._rendered(samples)
        images = [list(s.get("images") or []) for s in samples]
        videos = [list(s.get("videos") or []) for s in samples]
        if self.drop_overlong:
            kept = [i for i in range(len(samples)) if self._fits(rendered[i], images[i], videos[i])]
            if not kept:
                raise self._all_overlong()
            rendered, images = [rendered[i] for i in kept], [images[i] for i in kept]
            videos = [videos[i] for i in kept]
        batch, rendered = self._tokenized(self._process(rendered, images, videos, **self._padding()), rendered)
        input_ids = batch["input_ids"]
        attention = batch.get("attention_mask", torch.ones_like(input_ids))
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        for row, (_, ids, mask) in enumerate(rendered):
            positions = attention[row].nonzero().flatten()  # left or right padding alike
            expanded = input_ids[row, positions].tolist()
            labels[row, positions] = torch.tensor(carry_labels(ids, mask, expanded, self.placeholders),
                                                  dtype=labels.dtype)
        batch["labels"] = labels
        return batch
