"""Pre-tokenized token shards in modded-nanogpt's ``.bin`` format (upstream's ``NanogptDataset``).

A shard is a header of 256 int32 values, then the tokens: ``header[0]`` is the magic number (20240520 for
fineweb.py's shards, always uint16 tokens; 278895051 for nanogpt_data_processor.py's, whose ``header[3]`` is the
bytes per token, 2 or 4), ``header[1]`` the version (1), ``header[2]`` the token count. Shards are read with a
numpy memory map, never unpickled.

Each sample is a window of ``seq_len + 1`` consecutive tokens given as upstream gives it: ``input_ids`` its first
``seq_len`` tokens, ``labels`` its last ``seq_len`` (each position's next token). The class declares
``labels_shifted``, so the recipe's loss does not shift them again. Windows do not overlap and never cross a
shard's end.

Unlike upstream's endless stream, the windows are a map-style data set, so the engine's samplers apply: each
data-parallel rank reads its own windows, an epoch is one pass over them, ``dataloader.shuffle`` shuffles them
(seeded), and a resumed run continues from the saved loader position. The data are token ids, so a run on them
needs no tokenizer (none is saved with the model then; the model's own special token ids stand).
"""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from automodel.errors import AutomodelError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSION = 1
LEGACY_MAGIC = 20240520  # fineweb.py: uint16 tokens
MAGIC = 278895051  # nanogpt_data_processor.py: header[3] is the bytes per token
KEY = "dataset.file_pattern"


def read_shard(path: str | Path) -> np.ndarray:
    """The tokens of one ``.bin`` shard as a read-only memory map, after checking its header and size."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise AutomodelError(f"{KEY}: '{path}' has {size} bytes, less than the {HEADER_BYTES}-byte header of a "
                             "token shard: the file is truncated or not a shard")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic not in (MAGIC, LEGACY_MAGIC):
        raise AutomodelError(f"{KEY}: '{path}' is not a modded-nanogpt token shard (magic number {magic}, expected "
                             f"{LEGACY_MAGIC} or {MAGIC})")
    if version != VERSION:
        raise AutomodelError(f"{KEY}: '{path}' is shard format version {version}; only version {VERSION} is read")
    width = 2 if magic == LEGACY_MAGIC else int(header[3])
    if width not in (2, 4):
        raise AutomodelError(f"{KEY}: '{path}' says {width} bytes per token (header[3]); a shard holds 2 (uint16) "
                             "or 4 (uint32)")
    expected = HEADER_BYTES + count * width
    if count < 0 or size != expected:
        raise AutomodelError(f"{KEY}: '{path}' has {size} bytes but its header announces {count} tokens "
                             f"({expected} bytes): the file is truncated or corrupted")
    return np.memmap(path, dtype=np.uint16 if width == 2 else np.uint32, mode="r", offset=HEADER_BYTES,
                     shape=(count,))


def window_starts(tokens: np.ndarray, length: int, bos_token: int | None) -> np.ndarray:
    """Where the non-overlapping windows of ``length`` tokens start; with ``bos_token``, each starts at the first
    BOS at or after the previous window's end (tokens before a shard's first BOS are skipped)."""
    if bos_token is None:
        return np.arange(0, len(tokens) - length + 1, length, dtype=np.int64)
    bos = np.flatnonzero(tokens == bos_token)
    starts: list[int] = []
    index = 0
    while index < len(bos) and bos[index] + length <= len(tokens):
        starts.append(int(bos[index]))
        index = int(np.searchsorted(bos, bos[index] + length))
    return np.asarray(starts, dtype=np.int64)


class NanogptDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens from modded-nanogpt ``.bin`` shards (see the module's docstring)."""

    pretokenized = True  # token ids already: a run on these data needs no tokenizer
    labels_shifted = True  # labels[i] is the token after input_ids[i]: the loss must not shift them again

    argument_help = {"file_pattern": "a glob of .bin shards, or a list of shard paths",
                     "seq_len": "tokens the model reads per sample, each labelled with the one after it (a window "
                                "of seq_len + 1 tokens)",
                     "shuffle_files": "read the shards in an order shuffled with the run's seed (rng.seed)",
                     "align_to_bos": "start every sample at a bos_token (tokens before it are skipped)",
                     "bos_token": "the token id that starts a document (needed by align_to_bos)",
                     "run_seed": "given by the recipe: rng.seed"}

    @staticmethod
    def argument_problems(arguments: Mapping[str, Any]) -> list[tuple[str, str]]:
        """``run_seed`` is the recipe's (``rng.seed``): a config cannot set it."""
        if arguments.get("run_seed") is not None:
            return [("run_seed", "is given by the recipe (rng.seed, which orders the shards with shuffle_files); set "
                                 "rng.seed instead")]
        return []

    def __init__(self, file_pattern: str | Sequence[str], seq_len: int, *, bos_token: int | None = None,
                 shuffle_files: bool = False, align_to_bos: bool = False, run_seed: int = 0):
        if isinstance(file_pattern, (str, Path)):
            files = sorted(glob.glob(str(file_pattern)))
        else:
            files = [str(name) for name in file_pattern]
        if not files:
            raise AutomodelError(f"{KEY}: no file matches '{file_pattern}'")
        missing = [name for name in files if not Path(name).is_file()]
        if missing:
            raise AutomodelError(f"{KEY}: '{missing[0]}' does not exist")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise AutomodelError(f"dataset.seq_len: {seq_len!r}; a positive number of tokens")
        if align_to_bos and bos_token is None:
            raise AutomodelError("dataset.bos_token: needed when align_to_bos is true (the id every sample starts "
                                 "with)")
        if shuffle_files:
            files = [files[i] for i in np.random.default_rng(run_seed).permutation(len(files))]
        self.files = files
        self.length = seq_len + 1
        self.shards = [read_shard(name) for name in files]
        self.starts = [window_starts(tokens, self.length, bos_token if align_to_bos else None)
                       for tokens in self.shards]
        self.offsets = np.cumsum([0] + [len(starts) for starts in self.starts])
        if self.offsets[-1] == 0:
            raise AutomodelError(f"{KEY}: the {len(files)} shard(s) hold no window of seq_len + 1 = {self.length} "
                                 "tokens" + (" starting at bos_token" if align_to_bos else ""))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        start = int(self.starts[shard][index - self.offsets[shard]])
        window = self.shards[shard][start:start + self.length].astype(np.int64).tolist()
        return {"input_ids": window[:-1], "labels": window[1:]}
