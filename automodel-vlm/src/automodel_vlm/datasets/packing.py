"""Packed VLM sequences: several image conversations per row, attention kept inside each (``packed_sequence``).

Each sample is tokenized alone by the recipe's collator (rendered, image placeholders expanded, assistant turns
labelled) and the samples are packed greedily in data set order into rows of at most ``pack_size`` tokens (a new
row starts when the next sample does not fit; samples are never reordered). A row carries ``position_ids`` that
restart at 0 with every sample and no ``attention_mask``: transformers then builds a causal mask that is
block-diagonal per sample from the position restarts. Each sample's first label is masked, so no token learns to
predict across a sample boundary and the row's loss is the sum of its samples' own losses. The media of a row
(``pixel_values`` and what else the processor returns per image) are concatenated in the order of the images in the
batch, which is the order in which the model scatters their features into the image tokens.

Models that place tokens with multi-axis rotary positions (Qwen2-VL's mrope and its kin: ``get_rope_index``) need
per-sample 3-axis positions, which these rows do not carry: :func:`packing_unsupported` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from automodel.config import Config, FieldErrors
from automodel.errors import AutomodelError, ConfigIssue
from automodel_vlm.datasets.collate import IGNORE_INDEX, VLMCollator

# The processor's per-token outputs besides these (token_type_ids, say) are concatenated along the sequence.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "labels")
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
    max_packs: int | None = field(default=None, metadata={"help": "stop after this many packed rows"})
    balance_media_tokens: bool = field(default=False, metadata={"help": (
        "upstream's media-balanced bin packing: false only (rows are packed in data set order)")})
    collate_max_length: int | None = field(default=None, metadata={"help": (
        "upstream's padded length of its packed collator: refused (rows are padded to pack_size)")})
    attn_implementation: str | None = field(default=None, metadata={"help": (
        "upstream's packed-mask backend: refused (the model's own attention keeps each sample apart)")})
    packing_format: str | None = field(default=None, metadata={"help": (
        "upstream's packed collator format (neat, thd): refused (rows are packed in data set order)")})
    post_tokenize_hook_fn: str | None = field(default=None, metadata={"help": (
        "upstream's per-sample hook after tokenization: refused (no hook runs here)")})

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
        if self.balance_media_tokens:
            errors["balance_media_tokens"] = ("true: upstream's media-balanced bin packing is not implemented; rows "
                                              "are packed greedily in data set order: set false or remove it")
        refused = {
            "collate_max_length": "packed rows are padded to pack_size; remove it (or set pack_size)",
            "attn_implementation": "packed rows keep each sample apart through position_ids with the model's own "
                                   "attention; remove it (model.attn_implementation chooses the attention)",
            "packing_format": "upstream's packed collators (neat, thd) are not implemented; rows are packed "
                              "greedily in data set order: remove it",
            "post_tokenize_hook_fn": "no hook runs on tokenized samples here (Gemma 4's thinking prefix is inserted "
                                     "by dataloader.collate_fn: {_target_: nemo_automodel.components.datasets.vlm."
                                     "collate_fns.gemma4_prefix_collate_fn}, which packing does not use); remove it",
        }
        errors.update({key: f"{getattr(self, key)}: {why}" for key, why in refused.items()
                       if getattr(self, key) is not None})
        if errors:
            raise FieldErrors(errors)

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
    loader = cfg.resolved.get("dataloader")
    if isinstance(loader, dict) and loader.get("collate_fn") is not None:
        issues.append(ConfigIssue("dataloader.collate_fn", "packed_sequence builds the training rows itself (each "
                                                           "sample tokenized by the recipe's collator); remove "
                                                           "collate_fn or packed_sequence"))
    distributed = cfg.distributed
    if distributed is not None and distributed.pp_size > 1:
        issues.append(ConfigIssue("packed_sequence", f"not with distributed.pp_size {distributed.pp_size}: "
                                                     "pipelined batches carry an attention mask, which would let "
                                                     "the samples of a row see each other; remove one of them"))
    return issues


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot train on packed rows, if it cannot."""
    if any(callable(getattr(module, "get_rope_index", None)) for module in model.modules()):
        return ("this model places its tokens with multi-axis rotary positions (mrope, from get_rope_index), which "
                "packed rows do not carry per sample yet; remove packed_sequence to train unpacked")
    return None


class PackedVLMDataset(Dataset):
    """Rows of samples (each row a list of the data set's samples) that fill at most ``settings.capacity`` tokens,
    measured by tokenizing each sample alone with ``collator``."""

    def __init__(self, dataset: Any, collator: VLMCollator, settings: VLMPackedSequenceConfig):
        self.dataset = dataset
        self.rows: list[list[int]] = []
        self.left_out = {"max_length": 0, "drop_long_samples": 0}
        used = 0
        for index in range(len(dataset)):
            length = collator([dataset[index]])["input_ids"].shape[1]
            if settings.max_length is not None and length > settings.max_length:
                self.left_out["max_length"] += 1
                continue
            if length > settings.pack_size:
                if not settings.drop_long_samples:
                    raise AutomodelError(f"packed_sequence.pack_size: sample {index} has {length} tokens, more than "
                                         f"pack_size ({settings.pack_size}); raise pack_size, or set "
                                         "drop_long_samples: true (or max_length) to leave such samples out")
                self.left_out["drop_long_samples"] += 1
                continue
            if not self.rows or used + length > settings.capacity:
                if settings.max_packs is not None and len(self.rows) == settings.max_packs:
                    break
                self.rows.append([])
                used = 0
            self.rows[-1].append(index)
            used += length
        if not self.rows:
            raise AutomodelError(f"packed_sequence: no sample is left to pack ({self.left_out['max_length']} longer "
                                 f"than max_length, {self.left_out['drop_long_samples']} longer than pack_size); "
                                 "raise max_length or pack_size")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[Any]:
        return [self.dataset[i] for i in self.rows[index]]


class PackedVLMCollator:
    """``collate(rows) -> {input_ids, labels, position_ids, token_count, pixel_values, ...}``: each row's samples
    tokenized alone by ``collator`` and laid end to end, padded to ``pack_size`` (the padding is a label-free
    segment of its own); no ``attention_mask``, so the model keeps attention within each sample."""

    def __init__(self, collator: VLMCollator, pack_size: int):
        self.collator, self.pack_size = collator, pack_size

    def __call__(self, rows: list[list[Any]]) -> dict[str, torch.Tensor]:
        pad = self.collator.processor.tokenizer.pad_token_id or 0
        size = len(rows)
        batch = {"input_ids": torch.full((size, self.pack_size), pad, dtype=torch.long),
                 "labels": torch.full((size, self.pack_size), IGNORE_INDEX, dtype=torch.long),
                 "position_ids": torch.zeros((size, self.pack_size), dtype=torch.long),
                 "token_count": torch.zeros(size, dtype=torch.long)}
        per_token: dict[str, torch.Tensor] = {}
        media: dict[str, list[torch.Tensor]] = {}
        for row, samples in enumerate(rows):
            start = 0
            for sample in samples:
                one = self.collator([sample])
                length = one["input_ids"].shape[1]
                end = start + length
                labels = one["labels"][0].clone()
                labels[0] = IGNORE_INDEX  # the previous sample's last token does not predict this one's first
                batch["input_ids"][row, start:end] = one["input_ids"][0]
                batch["labels"][row, start:end] = labels
                batch["position_ids"][row, start:end] = torch.arange(length)
                for key, value in one.items():
                    if key in SEQUENCE_KEYS or not isinstance(value, torch.Tensor):
                        continue
                    if value.dim() == 2 and value.shape == one["input_ids"].shape:
                        target = per_token.setdefault(key, torch.zeros((size, self.pack_size), dtype=value.dtype))
                        target[row, start:end] = value[0]
                    else:
                        media.setdefault(key, []).append(value)
                start = end
            batch["position_ids"][row, start:] = torch.arange(self.pack_size - start)
            batch["token_count"][row] = start
        return {**batch, **per_token, **{key: torch.cat(values) for key, values in media.items()}}
