"""Upstream's ``MegatronPretraining``: GPT samples from Megatron's indexed token files (see ``indexed.py``).

What it does, as Megatron's GPT data set does, in numpy:

- ``split`` ("99,1,0" or "0.99, 0.01, 0.00": train, validation, test weights, normalized) cuts each file's
  documents into three consecutive ranges (each range's size rounded, the last end at the document count);
  ``splits_to_build`` picks the range this section reads. A ``paths`` dict gives each split its own files whole.
- A sample is ``seq_length + 1`` consecutive tokens of the documents laid end to end in a shuffled order; samples
  follow each other every ``seq_length`` tokens (one token shared), so they span document ends. As many epochs of
  the documents are laid down as the asked number of samples needs, each epoch's documents shuffled anew, and the
  samples themselves are shuffled; all from ``seed``.
- Blended ``paths`` (``[w1, prefix1, w2, prefix2]``): each file gives ``ceil(samples x weight x 1.005)``
  samples of its own, and the blend interleaves them so that every prefix of it holds the files in the weights'
  proportions. Files without weights are weighted by their sizes in tokens.

Megatron's own orders (its C++ index helpers) are not reproduced: the documents and samples are the same kind,
the draws differ. A sample of ``seq_length + 1`` tokens is Megatron's (and upstream's) pair: ``input_ids`` its first
``seq_length`` tokens, ``labels`` its last ``seq_length``, each position labelled with the token after it. The
class declares ``labels_shifted``, so the recipe's loss pairs the logits and labels of the same positions (it shifts
no further), and the model reads ``seq_length`` tokens: GPT-2's 1024 fit its 1024 learned positions, and lengths
upstream divides (2 x cp_size, pipeline shapes) stay divisible.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from automodel.errors import AutomodelError
from automodel_llm.datasets.indexed import IndexedTokens

SPLITS = ("train", "validation", "test")
_SPLIT_NAMES = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation",
                "dev": "validation", "test": "test"}
BLEND_SURPLUS = 0.005  # Megatron's margin: each file of a blend builds this much more than its share


def parse_split(split: str | Sequence[float | str]) -> list[float]:
    """``"99,1,0"`` / ``"0.99, 0.01"`` / ``[99, 1, 0]`` as three weights summing to 1 (missing ones are 0)."""
    parts = re.findall(r"[.0-9]+", split) if isinstance(split, str) else list(split)
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or sum(weights) <= 0 or min(weights) < 0:
        raise AutomodelError(f"dataset.split: {split!r}; expected up to three non-negative numbers for train, "
                             "validation and test, such as \"99,1,0\"")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def split_ranges(weights: Sequence[float], count: int) -> list[tuple[int, int]]:
    """The (start, end) document ranges of the three splits of ``count`` documents: each size rounded, the
    ends shifted so the last one is ``count`` (Megatron's rule)."""
    ends = [0]
    for weight in weights:
        ends.append(ends[-1] + int(round(weight * count)))
    ends[1:] = [end - (ends[-1] - count) for end in ends[1:]]
    return [(max(ends[i], 0), max(ends[i + 1], 0)) for i in range(3)]


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def parse_blend(paths: Any, key: str = "dataset.paths") -> tuple[list[str], list[float] | None]:
    """Prefixes and weights (None: unweighted) of a path, a glob of .bin / .idx files, or a list of prefixes or of
    weight, prefix pairs."""
    if isinstance(paths, (str, Path)):
        paths = str(paths)
        if not glob.has_magic(paths):
            return [paths], None
        found = sorted(glob.glob(paths))
        if not found:
            raise AutomodelError(f"{key}: no file matches '{paths}'")
        odd = [name for name in found if Path(name).suffix not in (".bin", ".idx")]
        if odd:
            raise AutomodelError(f"{key}: '{odd[0]}' matches '{paths}' but is not a .bin or .idx file")
        return sorted({str(Path(name).with_suffix("")) for name in found}), None
    if not isinstance(paths, (list, tuple)) or not paths:
        raise AutomodelError(f"{key}: expected a prefix, a glob, a JSON file or a list, found {paths!r}")
    if not _is_number(paths[0]):
        return [p for entry in paths for p in parse_blend(str(entry), key)[0]], None
    if len(paths) % 2 or not all(_is_number(w) for w in paths[::2]) or any(_is_number(p) for p in paths[1::2]):
        raise AutomodelError(f"{key}: a weighted blend is [weight, prefix, weight, prefix, ...]; found {paths!r}")
    weights = [float(w) for w in paths[::2]]
    if min(weights) < 0 or sum(weights) <= 0:
        raise AutomodelError(f"{key}: the weights {weights} must be >= 0 and not all 0")
    return [str(p) for p in paths[1::2]], [w / sum(weights) for w in weights]


def _read_json(path: str, key: str) -> Any:
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except OSError as err:
        raise AutomodelError(f"{key}: cannot read '{path}': {err.strerror}") from None
    except ValueError as err:
        raise AutomodelError(f"{key}: '{path}' is not JSON: {err}") from None


def per_split_paths(paths: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A ``paths`` dict's keys as split names (valid / val / dev are validation)."""
    unknown = [name for name in paths if name not in _SPLIT_NAMES]
    if unknown:
        raise AutomodelError(f"{key}.{unknown[0]}: not a split; a paths mapping has train, validation (valid, "
                             "val, dev) and test")
    return {_SPLIT_NAMES[name]: value for name, value in paths.items()}


def document_order(lengths: np.ndarray, documents: np.ndarray, num_samples: int | None, seq_length: int,
                   rng: np.random.RandomState) -> tuple[np.ndarray, int]:
    """The documents laid end to end (as many epochs of ``documents`` as the samples need, each shuffled) and the
    sample count: ``num_samples``, or one epoch's worth when None. Sample ``k`` is the ``seq_length + 1`` tokens
    from ``k x seq_length`` of that stream."""
    tokens = int(lengths[documents].sum())
    per_epoch = (tokens - 1) // seq_length
    if per_epoch < 1:
        raise AutomodelError(f"{len(documents)} documents of {tokens} tokens, fewer than one sample of "
                             f"seq_length + 1 = {seq_length + 1}")
    count = per_epoch if num_samples is None else num_samples
    epochs = 1
    while (epochs * tokens - 1) // seq_length < count:
        epochs += 1
    return np.concatenate([rng.permutation(documents) for _ in range(epochs)]).astype(np.int64), count


class _GPTSamples:
    """The samples of one file's split: ``seq_length + 1`` tokens from ``start`` in the shuffled stream."""

    def __init__(self, source: IndexedTokens, split: str, documents: np.ndarray, num_samples: int | None,
                 seq_length: int, seed: int, cache: Path | None):
        self.source, self.split, self.seq_length = source, split, seq_length
        arrays = _cached(cache, [source.prefix, len(source), int(source.lengths.sum()),
                                 int(documents[0]) if len(documents) else 0,
                                 len(documents), num_samples, seq_length, seed],
                         lambda: self._build(documents, num_samples, seed))
        self.order, self.shuffle = arrays["order"], arrays["shuffle"]
        self.ends = np.cumsum(source.lengths[self.order].astype(np.int64))

    def _build(self, documents: np.ndarray, num_samples: int | None, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.RandomState(seed)
        try:
            order, count = document_order(self.source.lengths, documents, num_samples, self.seq_length, rng)
        except AutomodelError as err:
            raise AutomodelError(f"dataset.split: the {self.split} split of '{self.source.prefix}' holds {err}: "
                                 "give it more of the documents (split) or lower seq_length") from None
        return {"order": order, "shuffle": rng.permutation(count).astype(np.int64)}

    def __len__(self) -> int:
        return len(self.shuffle)

    def __getitem__(self, index: int) -> np.ndarray:
        start = int(self.shuffle[index]) * self.seq_length
        position = int(np.searchsorted(self.ends, start, side="right"))
        offset = start - (int(self.ends[position - 1]) if position else 0)
        pieces, needed = [], self.seq_length + 1
        while needed:
            document = int(self.order[position])
            piece = self.source.get(document, offset, min(needed, int(self.source.lengths[document]) - offset))
            pieces.append(piece)
            needed -= len(piece)
            position, offset = position + 1, 0
        return np.concatenate(pieces).astype(np.int64)


def _cached(directory: Path | None, identity: list[Any], build) -> dict[str, np.ndarray]:
    """``build()``'s arrays, kept in ``directory`` (``index_mapping_dir``) as .npy files named by ``identity``'s
    hash and read from there by a later run with the same files and settings."""
    if directory is None:
        return build()
    name = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    paths = {part: directory / f"{name}_{part}.npy" for part in ("order", "shuffle")}
    if all(path.is_file() for path in paths.values()):
        return {part: np.load(path, allow_pickle=False) for part, path in paths.items()}
    arrays = build()
    directory.mkdir(parents=True, exist_ok=True)
    for part, path in paths.items():  # written aside, then renamed: a rank reading it meanwhile never sees half
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")
        np.save(partial, arrays[part], allow_pickle=False)
        os.replace(partial, path)
    return arrays


def blend_order(sizes: Sequence[int], weights: Sequence[float], count: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``count`` blended samples, its file and its index in that file: file ``d``'s ``k``-th sample
    comes at ``k / weight_d`` (ties in file order), so each prefix of the blend follows the weights."""
    keys = [np.arange(size) / weight if weight > 0 else np.full(size, np.inf)
            for size, weight in zip(sizes, weights, strict=True)]
    files = np.concatenate([np.full(size, d, dtype=np.int64) for d, size in enumerate(sizes)])
    within = np.concatenate([np.arange(size, dtype=np.int64) for size in sizes])
    chosen = np.lexsort((files, np.concatenate(keys)))[:count]
    return files[chosen], within[chosen]


class MegatronPretraining(Dataset):
    """GPT samples of one split of Megatron indexed files (see the module's docstring)."""

    pretokenized = True  # token ids already: a run on these data needs no tokenizer
    labels_shifted = True  # labels[i] is the token after input_ids[i]: the loss must not shift them again
    dataloader_types = ("single", "cyclic")  # upstream's Megatron samplers, which dataloader.dataloader_type picks

    argument_help = {
        "paths": "a prefix (<prefix>.bin / .idx), a glob of such files, a JSON file, a list of prefixes, a list of "
                 "weight, prefix pairs (a blend), or {train, validation, test} each of those",
        "seq_length": "tokens the model reads per sample, each labelled with the one after it (a sample spans "
                      "seq_length + 1 tokens of the files; default 2048)",
        "seed": "orders the documents and samples (default 1234)",
        "split": "train, validation, test weights of each file's documents (default \"900,50,50\"; not with a "
                 "paths mapping)",
        "splits_to_build": "the split this section reads: train, validation or test",
        "num_train_samples": "training samples (default: step_scheduler.max_steps x global batch size; one epoch "
                             "without max_steps)",
        "num_val_samples": "validation samples (default: one pass over the split)",
        "num_test_samples": "test samples (default: one pass over the split)",
        "index_mapping_dir": "a directory where the built sample indices are kept and read again by later runs",
        "mmap_bin_files": "memory-map the .bin files (true, default) or read each sample from the file",
        "create_attention_mask": "false only: the models build their causal mask themselves",
        "num_dataset_builder_threads": "1 only: the indices are built in one thread",
        "run_samples": "given by the recipe: max_steps x global batch size",
        "tokenizer": "the run's tokenizer (upstream's form names it here; the recipe builds it and saves it with "
                     "the model): the files hold its token ids",
    }

    @staticmethod
    def argument_problems(arguments: Mapping[str, Any]) -> list[tuple[str, str]]:
        """What upstream's dataset section takes that nothing here would act on."""
        problems = []
        if arguments.get("run_samples") is not None:
            problems.append(("run_samples", "is given by the recipe (step_scheduler.max_steps x global batch "
                                            "size); set num_train_samples instead"))
        if arguments.get("create_attention_mask"):
            problems.append(("create_attention_mask", "the models here build their causal attention mask "
                                                      "themselves (Megatron's explicit mask is for its own "
                                                      "attention): remove the key or set it to false"))
        if arguments.get("num_dataset_builder_threads", 1) != 1:
            problems.append(("num_dataset_builder_threads", "the sample indices are built in one thread here "
                                                            "(numpy, in seconds): remove the key"))
        if arguments.get("object_storage_config") is not None:
            problems.append(("object_storage_config", "reading .bin / .idx from S3 or a multi-storage client is not "
                                                      "implemented: copy the files to a local or shared disk"))
        for name, why in _SCHEDULE_KEYS.items():
            if arguments.get(name) is not None:
                problems.append((name, why))
        split = arguments.get("splits_to_build")
        if split not in SPLITS:
            problems.append(("splits_to_build", ("missing" if split is None else repr(split)) + "; say which split "
                                                "this section reads: train, validation or test"))
        return problems

    def __init__(self, paths: Any, seq_length: int = 2048, seed: int = 1234, split: str = "900,50,50",
                 splits_to_build: str | None = None, num_train_samples: int | None = None,
                 num_val_samples: int | None = None, num_test_samples: int | None = None,
                 index_mapping_dir: str | None = None, mmap_bin_files: bool = True,
                 create_attention_mask: bool = False, num_dataset_builder_threads: int = 1,
                 object_storage_config: Mapping[str, Any] | None = None, trainer_max_steps: int | None = None,
                 trainer_val_check_interval: int | None = None, trainer_limit_val_batches: float | None = None,
                 trainer_limit_test_batches: float | None = None, micro_batch_size: int | None = None,
                 global_batch_size: int | None = None, run_samples: int | None = None, tokenizer: Any = None):
        given = {k: v for k, v in locals().items() if k not in ("self", "run_samples", "tokenizer")}
        problems = self.argument_problems(given)
        if problems:
            raise AutomodelError(f"dataset.{problems[0][0]}: {problems[0][1]}")
        if not isinstance(seq_length, int) or seq_length < 1:
            raise AutomodelError(f"dataset.seq_length: {seq_length!r}; a positive number of tokens")
        which = SPLITS.index(splits_to_build)
        asked = (num_train_samples if num_train_samples is not None else run_samples, num_val_samples,
                 num_test_samples)[which]
        if isinstance(paths, (str, Path)) and str(paths).endswith(".json"):  # a list, or a mapping of splits
            paths = _read_json(str(paths), "dataset.paths")
        if isinstance(paths, Mapping):
            split_paths = per_split_paths(paths, "dataset.paths")
            if splits_to_build not in split_paths:
                raise AutomodelError(f"dataset.paths: the mapping has no '{splits_to_build}' files "
                                     f"(splits_to_build: {splits_to_build})")
            prefixes, weights = parse_blend(split_paths[splits_to_build], f"dataset.paths.{splits_to_build}")
            fraction = None
        else:
            prefixes, weights = parse_blend(paths)
            fraction = parse_split(split)
        cache = Path(index_mapping_dir) if index_mapping_dir else None
        sources = [IndexedTokens(prefix, mmap=mmap_bin_files) for prefix in prefixes]
        ranges = [(0, len(s)) if fraction is None else split_ranges(fraction, len(s))[which] for s in sources]
        for source, (start, end) in zip(sources, ranges, strict=True):
            if end <= start:
                raise AutomodelError(f"dataset.split: '{source.prefix}' has {len(source)} documents, and the "
                                     f"{splits_to_build} split of {split!r} gives it none; change split or the "
                                     "files")
        if weights is None and len(sources) > 1:  # unweighted: each file by its tokens in the split
            tokens = [float(s.lengths[start:end].sum()) for s, (start, end) in zip(sources, ranges, strict=True)]
            weights = [t / sum(tokens) for t in tokens]
        if weights is None:
            shares = [asked]
        elif asked is None:
            shares = [None] * len(sources)  # one pass over every file, blended by the weights
        else:
            shares = [math.ceil(asked * w * (1 + BLEND_SURPLUS)) for w in weights]
        self.parts = [_GPTSamples(source, splits_to_build, np.arange(start, end, dtype=np.int64), share,
                                  seq_length, seed + i, cache)
                      for i, (source, (start, end), share) in enumerate(zip(sources, ranges, shares, strict=True))]
        if weights is None:
            self.files = np.zeros(len(self.parts[0]), dtype=np.int64)
            self.within = np.arange(len(self.parts[0]), dtype=np.int64)
        else:
            sizes = [len(part) for part in self.parts]
            count = asked if asked is not None else sum(sizes)
            self.files, self.within = blend_order(sizes, weights, count)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        tokens = torch.from_numpy(self.parts[int(self.files[index])][int(self.within[index])])
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


_SCHEDULE_KEYS = {
    name: f"upstream's constructor takes it from its recipe's schedule ({source}); here the recipe gives the "
          "samples it needs: remove the key (num_train_samples / num_val_samples set the counts)"
    for name, source in (("trainer_max_steps", "step_scheduler.max_steps"),
                         ("trainer_val_check_interval", "step_scheduler.val_every_steps"),
                         ("trainer_limit_val_batches", "its validation batch limit"),
                         ("trainer_limit_test_batches", "its test batch limit"),
                         ("micro_batch_size", "step_scheduler.local_batch_size"),
                         ("global_batch_size", "step_scheduler.global_batch_size"))
}
