"""Megatron's indexed token files (``<prefix>.idx`` + ``<prefix>.bin``), read with numpy and written from token ids
(``write_megatron.py`` tokenizes JSONL text into them).

The layout (megatron-core's ``indexed_dataset``, version 1), all little-endian:

``.idx``: the 9 bytes ``MMIDIDX\\x00\\x00``; the version (uint64, 1); the token dtype code (uint8: 1 uint8, 2 int8,
3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16); the sequence count S (uint64); the document-index count
D (uint64); then S int32 sequence lengths (tokens), S int64 sequence pointers (byte offsets into the ``.bin``), and
D int64 document indices (the sequence index where each document ends, starting with 0, so D = documents + 1).

``.bin``: the tokens of every sequence, one after the other, in the dtype of the code.

Files are memory-mapped (or read on demand with ``mmap=False``), never unpickled; a file that does not hold what its
header announces is refused by name. Multimodal indices (a trailing mode per sequence) are not read.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from automodel.errors import AutomodelError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, sequence count, document-index count


class IndexedTokens:
    """The sequences of one ``<prefix>.idx`` / ``<prefix>.bin`` pair; ``key`` names the config key in errors."""

    def __init__(self, prefix: str | Path, key: str = "dataset.paths", mmap: bool = True):
        self.prefix = str(prefix)
        idx, self.bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for path in (idx, self.bin_path):
            if not path.is_file():
                raise AutomodelError(f"{key}: '{path}' does not exist (a Megatron data set is a <prefix>.idx and a "
                                     "<prefix>.bin; give the prefix without the suffix)")
        raw = np.memmap(idx, dtype=np.uint8, mode="r") if idx.stat().st_size else np.zeros(0, np.uint8)
        self.dtype = _read_header(raw, idx, key)
        sequences, documents = (int(v) for v in np.frombuffer(raw, np.uint64, 2, len(HEADER) + 9))
        expected = _FIXED + sequences * 12 + documents * 8
        if raw.size != expected:
            raise AutomodelError(f"{key}: '{idx}' has {raw.size} bytes but its header announces {sequences} "
                                 f"sequences and {documents} document indices ({expected} bytes): the file is "
                                 "truncated or corrupted")
        self.lengths = np.frombuffer(raw, np.int32, sequences, _FIXED)
        self.pointers = np.frombuffer(raw, np.int64, sequences, _FIXED + sequences * 4)
        self.document_indices = np.frombuffer(raw, np.int64, documents, _FIXED + sequences * 12)
        width = np.dtype(self.dtype).itemsize
        starts = np.concatenate([[0], np.cumsum(self.lengths.astype(np.int64) * width)])
        if (self.lengths < 0).any() or not np.array_equal(self.pointers, starts[:-1]):
            raise AutomodelError(f"{key}: '{idx}' holds sequence pointers that do not follow its sequence lengths: "
                                 "the file is corrupted")
        ends = self.document_indices
        if documents < 1 or ends[0] != 0 or ends[-1] != sequences or (np.diff(ends) < 0).any():
            raise AutomodelError(f"{key}: '{idx}' holds document indices that do not run from 0 to its "
                                 f"{sequences} sequences: the file is corrupted")
        size = self.bin_path.stat().st_size
        if size != starts[-1]:
            raise AutomodelError(f"{key}: '{self.bin_path}' has {size} bytes but '{idx}' announces "
                                 f"{int(starts[-1])} ({int(starts[-1]) // width} tokens of {np.dtype(self.dtype)}): "
                                 "the file is truncated or does not belong to this index")
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if mmap and size else None

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset`` to ``offset + length`` (default: the rest) of sequence ``index``."""
        length = int(self.lengths[index]) - offset if length is None else length
        start = int(self.pointers[index]) // np.dtype(self.dtype).itemsize + offset
        if self.tokens is not None:
            return self.tokens[start:start + length]
        return np.fromfile(self.bin_path, dtype=self.dtype, count=length,
                           offset=start * np.dtype(self.dtype).itemsize)


def _read_header(raw: np.ndarray, path: Path, key: str) -> Any:
    """The token dtype of an ``.idx`` file after checking its magic bytes, version and dtype code."""
    if raw.size < _FIXED:
        raise AutomodelError(f"{key}: '{path}' has {raw.size} bytes, less than the {_FIXED}-byte header of a "
                             "Megatron index: the file is truncated or not an index")
    if bytes(raw[:len(HEADER)]) != HEADER:
        raise AutomodelError(f"{key}: '{path}' is not a Megatron index (it does not start with MMIDIDX)")
    version = struct.unpack_from("<Q", raw, len(HEADER))[0]
    if version != VERSION:
        raise AutomodelError(f"{key}: '{path}' is index version {version}; only version {VERSION} is read")
    code = int(raw[len(HEADER) + 8])
    if code not in DTYPES:
        raise AutomodelError(f"{key}: '{path}' names token dtype code {code}; the format knows 1 to 8")
    return DTYPES[code]


def write_indexed(prefix: str | Path, documents: Iterable[Sequence[int]], dtype: Any = np.int32) -> int:
    """Write ``documents`` (token id lists, one sequence each) as ``<prefix>.bin`` / ``<prefix>.idx`` in
    Megatron's layout; returns how many were written. ``dtype`` is the token type (uint16 holds vocabularies
    below 65536, int32 the rest)."""
    code = {np.dtype(v): k for k, v in DTYPES.items()}.get(np.dtype(dtype))
    if code is None:
        raise AutomodelError(f"write_indexed: dtype {dtype} is not one of Megatron's token types")
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    lengths: list[int] = []
    try:
        with open(prefix + ".bin", "wb") as out:
            for tokens in documents:
                array = np.asarray(tokens, dtype=dtype)
                out.write(array.tobytes(order="C"))
                lengths.append(len(array))
    except BaseException:
        Path(prefix + ".bin").unlink(missing_ok=True)  # no data file without its index
        raise
    pointers = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64) * np.dtype(dtype).itemsize)])[:-1]
    with open(prefix + ".idx", "wb") as out:
        out.write(HEADER + struct.pack("<QBQQ", VERSION, code, len(lengths), len(lengths) + 1))
        out.write(np.asarray(lengths, np.int32).tobytes())
        out.write(np.asarray(pointers, np.int64).tobytes())
        out.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    return len(lengths)
