"""Packed VLM sequences: several image conversations per row, attention kept inside each (``packed_sequence``).

Each sample is tokenized alone by the recipe's collator (rendered, image placeholders expanded, assistant turns
labelled; with ``post_tokenize_hook_fn``, Gemma 4's thinking prefix inserted after each model turn, unlabelled, as
upstream's hook does) and the samples are packed greedily in data set order into rows of at most ``pack_size``
tokens (a new row starts when the next sample does not fit; samples are never reordered), or with
``balance_media_tokens`` as upstream balances them by image tokens (:func:`media_balanced_rows`). This is upstream's
``packing_format: neat``. A row carries ``position_ids`` that restart at 0 with every sample and no
``attention_mask``: transformers then builds a causal mask that is block-diagonal per sample from the position
restarts. Each sample's first label is masked, so no token learns to predict across a sample boundary and the row's
loss is the sum of its samples' own losses. The media of a row (``pixel_values`` and what else the processor returns
per image) are concatenated in the order of the images in the batch, which is the order in which the model scatters
their features into the image tokens.

Models that place tokens with multi-axis rotary positions (Qwen2-VL's mrope and its kin) get each sample's own
3-axis positions from the model's ``get_rope_index``, concatenated, under a first row of text positions that
restart per sample: ``position_ids`` ``[4, batch, length]``, the form these models' forward reads as packed (the
first row builds the per-sample mask). A model with ``get_rope_index`` whose code does not read that form is
refused (:func:`packing_unsupported`).
"""

from __future__ import annotations

import heapq
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from automodel.config import Config, FieldErrors
from automodel.errors import AutomodelError, ConfigIssue
from automodel_vlm.datasets.collate import IGNORE_INDEX, VLMCollator

# The processor's per-token outputs besides these (token_type_ids, say) are concatenated along the sequence.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "labels")
# What a sample's get_rope_index call reads from the processor's outputs (besides input_ids and attention_mask).
ROPE_INPUTS = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
# How a model's forward recognises packed multi-axis positions: a text-position row on top of the 3 rope rows.
PACKED_ROPE_FORM = "position_ids.shape[0] == 4"
# upstream's Gemma 4 hook, by its upstream name and ours: each sample gets the thinking prefix (datasets.gemma4)
THINKING_PREFIX_HOOKS = ("nemo_automodel.components.datasets.vlm.collate_fns.gemma4_inject_thinking_prefix",
                         "automodel_vlm.datasets.gemma4.inject_thinking_prefix")
MISSING_PACK_SIZE = "{}: set the tokens per packed row (at least 2), or remove packed_sequence to train unpacked"


@dataclass
class VLMPackedSequenceConfig:
    pretokenize: bool = field(default=True, metadata={"help": (
        "tokenize each sample with the processor before packing: true only (packing measures every sample)")})
    pack_size: int = field(default=0, metadata={"help": (
        "tokens per packed row, at least 2 (required when packed_sequence is given)")})
    max_length: int | None = field(default=None, metadata={"help": (
        "samples longer than this many tokens are left out before packing (upstream replaces them)")})
    packing_ratio: float = field(default=1.0, metadata={"help": (
        "rows are filled up to pack_size x packing_ratio tokens (a longer sample still gets a row of its own)")})
    drop_long_samples: bool = field(default=False, metadata={"help": (
        "leave out the samples longer than pack_size (false: such a sample is an error)")})
    max_packs: int | None = field(default=None, metadata={"help": (
        "at most this many packed rows: the first ones (in image-token order with balance_media_tokens)")})
    balance_media_tokens: bool = field(default=False, metadata={"help": (
        "upstream's media-balanced packing: the longest samples first, each into the least-filled row it fits, rows "
        "ordered by their image tokens (false: rows filled in data set order)")})
    collate_max_length: int | None = field(default=None, metadata={"help": (
        "the length packed rows are padded to, at least pack_size (default: pack_size)")})
    attn_implementation: str | None = field(default=None, metadata={"help": (
        "upstream's packed-mask backend under context parallelism: sdpa (what the context-parallel attention runs, "
        "with each row's exact mask); another value is refused with cp_size > 1; with cp_size 1 it governs nothing "
        "(upstream ignores it then too; a note says so)")})
    packing_format: str = field(default="neat", metadata={"help": (
        "upstream's packed batch format: neat only (positions restarting per sample, attention and loss within each "
        "sample); thd (cu_seqlens for Transformer Engine on CUDA) is refused")})
    post_tokenize_hook_fn: str | None = field(default=None, metadata={"help": (
        "upstream's hook on each tokenized sample: Gemma 4's thinking prefix (...collate_fns."
        "gemma4_inject_thinking_prefix) only, inserted after every model turn, unlabelled")})

    def __post_init__(self) -> None:
        errors = {}
        if not self.pretokenize:
            errors["pretokenize"] = ("false: packing tokenizes every sample with the processor to measure it; set "
                                     "true (or remove packed_sequence to train unpacked)")
        if self.pack_size < 0 or self.pack_size == 1:
            errors["pack_size"] = MISSING_PACK_SIZE.format(self.pack_size)
        if self.max_length is not None and self.max_length < 1:
            errors["max_length"] = f"{self.max_length}: must be at least 1 (or remove it)"
        if not 0 < self.packing_ratio <= 1:
            errors["packing_ratio"] = f"{self.packing_ratio}: must be in (0, 1] (the share of pack_size rows fill)"
        if self.max_packs is not None and self.max_packs < 1:
            errors["max_packs"] = f"{self.max_packs}: must be at least 1 (or remove it)"
        if self.collate_max_length is not None and self.collate_max_length < max(self.pack_size, 1):
            errors["collate_max_length"] = (f"{self.collate_max_length}: rows of pack_size ({self.pack_size}) tokens "
                                            "are padded to it, so it must be at least pack_size (or remove it)")
        if self.packing_format == "thd":
            errors["packing_format"] = ("thd: THD batches (samples concatenated with cu_seqlens, qkv_format thd) "
                                        "feed Transformer Engine's attention kernels, which need a CUDA GPU and "
                                        "Transformer Engine; use neat (rows for Hugging Face attention) or remove it")
        elif self.packing_format != "neat":
            errors["packing_format"] = (f"{self.packing_format}: upstream's packed formats are neat (what packing "
                                        "builds here) and thd (refused); use neat or remove it")
        if self.post_tokenize_hook_fn is not None and self.post_tokenize_hook_fn not in THINKING_PREFIX_HOOKS:
            errors["post_tokenize_hook_fn"] = (f"{self.post_tokenize_hook_fn}: the only hook on tokenized samples "
                                               f"here is Gemma 4's thinking prefix ({THINKING_PREFIX_HOOKS[0]}); "
                                               "use it or remove the key")
        if errors:
            raise FieldErrors(errors)

    def sample_collator(self, processor: Any) -> VLMCollator:
        """The collation each sample is tokenized with alone: Gemma 4's with the hook, else the default one."""
        if self.post_tokenize_hook_fn is None:
            return VLMCollator(processor)
        from automodel_vlm.datasets.gemma4 import Gemma4PrefixCollator

        return Gemma4PrefixCollator(processor)

    @property
    def padded_length(self) -> int:
        """The length every packed row is padded to."""
        return self.collate_max_length or self.pack_size

    @property
    def capacity(self) -> int:
        """The tokens a row is filled up to."""
        return max(int(self.pack_size * self.packing_ratio), 1)


def packing_issues(cfg: Config) -> list[ConfigIssue]:
    """What a given ``packed_sequence`` section cannot go with."""
    issues = []
    settings = cfg.get("packed_sequence")
    if isinstance(settings, VLMPackedSequenceConfig) and settings.pack_size == 0:
        issues.append(ConfigIssue("packed_sequence.pack_size", MISSING_PACK_SIZE.format("missing or 0")))
    cp_size = cfg.distributed.cp_size if cfg.distributed is not None else 1
    backend = getattr(settings, "attn_implementation", None)
    if cp_size > 1 and backend not in (None, "sdpa"):
        issues.append(ConfigIssue("packed_sequence.attn_implementation", f"{backend}: with cp_size {cp_size} the "
                                  "packed rows' attention is the context-parallel attention's SDPA, with each row's "
                                  "exact mask; use sdpa or remove it"))
    loader = cfg.resolved.get("dataloader")
    if isinstance(loader, dict) and loader.get("collate_fn") is not None:
        issues.append(ConfigIssue("dataloader.collate_fn", "packed_sequence builds the training rows itself (each "
                                                           "sample tokenized by the recipe's collator); remove "
                                                           "collate_fn or packed_sequence"))
    return issues


def packed_attention_note(settings: VLMPackedSequenceConfig, cp_size: int) -> str | None:
    """The note that ``attn_implementation`` governs nothing without context parallelism (upstream's rule)."""
    if settings.attn_implementation is None or cp_size > 1:
        return None
    return (f"note: packed_sequence.attn_implementation: {settings.attn_implementation} governs nothing this run: it "
            "chooses upstream's packed-mask backend under context parallelism (cp_size 1 here; upstream ignores it "
            "then too); the model's attention keeps each sample apart")


def rope_index(model: torch.nn.Module) -> Callable[..., Any] | None:
    """The model's ``get_rope_index`` (multi-axis rotary positions), if it has one."""
    return next((module.get_rope_index for module in model.modules()
                 if callable(getattr(module, "get_rope_index", None))), None)


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot train on packed rows, if it cannot."""
    found = rope_index(model)
    if found is None:
        return None
    owner = type(found.__self__)
    if PACKED_ROPE_FORM in inspect.getsource(sys.modules[owner.__module__]):
        return None
    return (f"{owner.__name__} places its tokens with multi-axis rotary positions (get_rope_index) and its forward "
            "does not read packed positions (a text-position row on top of them); remove packed_sequence to train "
            "unpacked")


def cut_sample(one: dict[str, Any], length: int, placeholders: set[int]) -> dict[str, Any]:
    """A one-sample batch cut to its first ``length`` tokens (every entry indexed by token; labels were built on the
    whole sample), refused where the cut would go through image tokens: their features would have no place."""
    ids = one["input_ids"]
    media = one.get("mm_token_type_ids")
    through_media = media is not None and bool(media[0, length:].any())
    if through_media or any(t in placeholders for t in ids[0, length:].tolist()):
        raise AutomodelError(f"dataset.truncate: a sample of {ids.shape[1]} tokens would be cut through its image "
                             f"tokens at packed_sequence.max_length ({length}); raise max_length, or set truncate: "
                             "false to leave the samples longer than it out")
    return {key: value[:, :length] if isinstance(value, torch.Tensor) and value.shape == ids.shape else value
            for key, value in one.items()}


def greedy_rows(measured: Iterable[tuple[int, int, int]], capacity: int, max_packs: int | None) -> list[list[int]]:
    """Rows of sample indices filled in data set order up to ``capacity`` tokens, a new row where the next sample
    does not fit, at most ``max_packs`` rows (``measured``: (index, tokens, image tokens) per sample, read only as
    far as the rows need)."""
    rows: list[list[int]] = []
    used = 0
    for index, length, _ in measured:
        if not rows or used + length > capacity:
            if max_packs is not None and len(rows) == max_packs:
                break
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows


def media_balanced_rows(measured: Iterable[tuple[int, int, int]], capacity: int,
                        max_packs: int | None) -> list[list[int]]:
    """upstream's media-balanced packing (``balance_media_tokens``): the samples longest first (ties in data set
    order), each into the least-filled row it fits in up to ``capacity`` tokens (else a row of its own); the rows
    then ordered by their image tokens, fewest first, and the first ``max_packs`` kept.

    The order is the balance: data-parallel ranks take neighbouring rows in one step (with ``shuffle: false``), so
    their vision encoders get similar work and no rank waits on one with many more images. Deterministic: the
    same samples give the same rows."""
    rows: list[list[int]] = []
    media: list[int] = []
    fills: list[tuple[int, int]] = []  # a heap of (tokens, row): the least-filled row first
    for index, length, image_tokens in sorted(measured, key=lambda sample: -sample[1]):
        if fills and fills[0][0] + length <= capacity:
            used, row = heapq.heappop(fills)
        else:
            used, row = 0, len(rows)
            rows.append([])
            media.append(0)
        rows[row].append(index)
        media[row] += image_tokens
        heapq.heappush(fills, (used + length, row))
    order = sorted(range(len(rows)), key=lambda row: media[row])
    return [rows[row] for row in order][:max_packs]


class PackedVLMDataset(Dataset):
    """Rows of samples (each row a list of the data set's samples) that fill at most ``settings.capacity`` tokens,
    measured by tokenizing each sample alone with ``collator``: in data set order (:func:`greedy_rows`), or with
    ``balance_media_tokens`` balanced by image tokens (:func:`media_balanced_rows`).

    Samples longer than ``settings.max_length`` are left out, or, where the data set says ``truncate`` (upstream's
    recipe-level key of the text-only chat data sets), cut to it (``cut_to``; :class:`PackedVLMCollator` cuts them
    alike)."""

    def __init__(self, dataset: Any, collator: VLMCollator, settings: VLMPackedSequenceConfig):
        self.dataset, self.collator = dataset, collator
        self.cut_to = settings.max_length if getattr(dataset, "truncate", False) else None
        self.left_out = {"max_length": 0, "drop_long_samples": 0}
        self.cut = 0
        pack = media_balanced_rows if settings.balance_media_tokens else greedy_rows
        self.rows = pack(self._measured(settings), settings.capacity, settings.max_packs)
        if not self.rows:
            raise AutomodelError(f"packed_sequence: no sample is left to pack ({self.left_out['max_length']} longer "
                                 f"than max_length, {self.left_out['drop_long_samples']} longer than pack_size); "
                                 "raise max_length or pack_size")

    def _measured(self, settings: VLMPackedSequenceConfig) -> Iterator[tuple[int, int, int]]:
        """(index, tokens, image tokens) of each sample that is packed, in data set order; counts those left out."""
        placeholders = torch.tensor(sorted(self.collator.placeholders), dtype=torch.long)
        for index in range(len(self.dataset)):
            one = self.collator([self.dataset[index]])
            length = one["input_ids"].shape[1]
            if settings.max_length is not None and length > settings.max_length:
                if self.cut_to is None:
                    self.left_out["max_length"] += 1
                    continue
                cut_sample(one, self.cut_to, self.collator.placeholders)  # refuses a cut through image tokens now
                length = self.cut_to
                self.cut += 1
            if length > settings.pack_size:
                if not settings.drop_long_samples:
                    raise AutomodelError(f"packed_sequence.pack_size: sample {index} has {length} tokens, more than "
                                         f"pack_size ({settings.pack_size}); raise pack_size, or set "
                                         "drop_long_samples: true (or max_length) to leave such samples out")
                self.left_out["drop_long_samples"] += 1
                continue
            yield index, length, int(torch.isin(one["input_ids"], placeholders).sum())

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[Any]:
        return [self.dataset[i] for i in self.rows[index]]


class PackedVLMCollator:
    """``collate(rows) -> {input_ids, labels, position_ids, token_count, pixel_values, ...}``: each row's samples
    tokenized alone by ``collator`` (cut to ``cut_to`` tokens where longer) and laid end to end, padded to
    ``pack_size`` tokens (``collate_max_length`` where given; the padding is a label-free segment of its own); no
    ``attention_mask``, so the model keeps attention within each sample."""

    def __init__(self, collator: VLMCollator, pack_size: int, rope_index: Callable[..., Any] | None = None,
                 cut_to: int | None = None):
        self.collator, self.pack_size, self.rope_index, self.cut_to = collator, pack_size, rope_index, cut_to

    def _rope_positions(self, one: dict[str, Any]) -> torch.Tensor:
        """A sample's ``[3, length]`` multi-axis positions (a sample without media: its text positions)."""
        length = one["input_ids"].shape[1]
        if not any(one.get(key) is not None for key in ("image_grid_thw", "video_grid_thw")):
            return torch.arange(length).expand(3, -1)
        positions, _ = self.rope_index(one["input_ids"], attention_mask=one["attention_mask"],
                                       **{key: one[key] for key in ROPE_INPUTS if key in one})
        return positions[:, 0]

    def __call__(self, rows: list[list[Any]]) -> dict[str, torch.Tensor]:
        pad = self.collator.processor.tokenizer.pad_token_id or 0
        size = len(rows)
        batch = {"input_ids": torch.full((size, self.pack_size), pad, dtype=torch.long),
                 "labels": torch.full((size, self.pack_size), IGNORE_INDEX, dtype=torch.long),
                 "position_ids": torch.zeros((size, self.pack_size) if self.rope_index is None else
                                             (4, size, self.pack_size), dtype=torch.long),
                 "token_count": torch.zeros(size, dtype=torch.long)}
        per_token: dict[str, torch.Tensor] = {}
        media: dict[str, list[torch.Tensor]] = {}
        for row, samples in enumerate(rows):
            start = 0
            for sample in samples:
                one = self.collator([sample])
                if self.cut_to is not None and one["input_ids"].shape[1] > self.cut_to:
                    one = cut_sample(one, self.cut_to, self.collator.placeholders)
                length = one["input_ids"].shape[1]
                end = start + length
                labels = one["labels"][0].clone()
                labels[0] = IGNORE_INDEX  # the previous sample's last token does not predict this one's first
                batch["input_ids"][row, start:end] = one["input_ids"][0]
                batch["labels"][row, start:end] = labels
                positions = batch["position_ids"]
                if self.rope_index is None:
                    positions[row, start:end] = torch.arange(length)
                else:  # the text row (the per-sample mask) on top of the sample's rope rows
                    positions[0, row, start:end] = torch.arange(length)
                    positions[1:, row, start:end] = self._rope_positions(one)
                for key, value in one.items():
                    if key in SEQUENCE_KEYS or not isinstance(value, torch.Tensor):
                        continue
                    if value.dim() == 2 and value.shape == one["input_ids"].shape:
                        target = per_token.setdefault(key, torch.zeros((size, self.pack_size), dtype=value.dtype))
                        target[row, start:end] = value[0]
                    else:
                        media.setdefault(key, []).append(value)
                start = end
            batch["position_ids"][..., row, start:] = torch.arange(self.pack_size - start)
            batch["token_count"][row] = start
        return {**batch, **per_token, **{key: torch.cat(values) for key, values in media.items()}}
