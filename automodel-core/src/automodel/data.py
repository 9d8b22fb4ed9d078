"""Reading data rows through ``datasets``: a hub name, or a local JSON/JSONL/CSV/parquet/text file or directory.

Shared by every domain (``datasets`` is imported on first use, so the core does not depend on it), with what
every data set does with a bad row (:class:`BadRows`, the ``on_bad_row`` argument of each data set).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

from automodel.errors import AutomodelError

OnBadRow = Literal["error", "skip"]

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_SLICED_SPLIT = re.compile(r"^[^\[\]+]+\[[^\[\]]*\]$")  # validation[:64], train[10%:]


def load_rows(name_or_path: str, split: str = "train", key: str = "dataset.dataset_name",
              name: str | None = None, revision: str | None = None, skip_malformed_lines: bool = False) -> Any:
    """A ``datasets.Dataset`` for one split; ``name`` picks the subset
    (configuration) of a hub data set or a data set directory with several, ``revision`` a hub data set's branch,
    tag or commit (a local file or directory has none). A single file is its own only split (:func:`_load_file`).
    ``skip_malformed_lines``: a local JSON Lines file's lines that are not JSON objects are left out and counted
    (:func:`well_formed_lines`) instead of failing the read.
    """
    import datasets

    datasets.disable_progress_bars()  # the training progress bar is the one to watch
    path = Path(str(name_or_path))
    if skip_malformed_lines and not is_json_lines(name_or_path):
        raise AutomodelError(f"{key}: '{name_or_path}' is not a JSON Lines file (.jsonl), the only kind whose "
                             "malformed lines can be skipped")
    if revision is not None and path.exists():
        raise AutomodelError(f"{key}: '{name_or_path}' is local, and revision '{revision}' names a version of a hub "
                             "data set; remove revision")
    try:
        if path.is_file():
            builder = _BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise AutomodelError(f"{key}: '{path}' has an unsupported extension; use one of "
                                     f"{', '.join(sorted(_BUILDERS))}")
            if path.stat().st_size == 0:
                raise AutomodelError(f"{key}: '{path}' is empty")
            with well_formed_lines(path, key) if skip_malformed_lines else nullcontext(path) as readable:
                return _load_file(builder, readable, split, key, path)
        if path.is_dir():
            return datasets.load_dataset(str(path), name, split=split)
        if path.is_absolute() or str(name_or_path).startswith(("./", "../")) or path.suffix in _BUILDERS:
            raise AutomodelError(f"{key}: '{name_or_path}' does not exist")
        hub = {"revision": revision} if revision is not None else {}
        return datasets.load_dataset(str(name_or_path), name, split=split, **hub)
    except AutomodelError:
        raise
    except Exception as err:  # datasets raises many types for a missing/offline hub name or a bad file
        files = [path] if path.is_file() else sorted(path.glob("*.json*")) if path.is_dir() else []
        for file in (f for f in files if f.suffix.lower() in (".json", ".jsonl")):
            where = json_problem(file)
            if where is not None:
                raise AutomodelError(f"{key}: '{file}' {where}; fix that line") from None
        if not isinstance(err, ValueError):
            hint = " (offline? point it at a local file or directory)" if not path.exists() else ""
            raise AutomodelError(f"{key}: cannot load '{name_or_path}'{hint}: {type(err).__name__}: {err}") from None
        raise AutomodelError(f"{key}: cannot read split '{split}' of '{name_or_path}': {err}") from None


def _load_file(builder: str, readable: Path, split: str, key: str, path: Path) -> Any:
    """The rows of one file (``path``, read from ``readable``), which is its own only split: ``train`` to
    ``datasets``, whatever ``split`` calls it; a row slice in ``split`` (``validation[:64]``, ``train[10%:]``) still
    selects rows."""
    import datasets

    rows = datasets.load_dataset(builder, data_files=str(readable), split="train")
    return select_row_slice(rows, split, key, f"'{path}' (a single file is its only split)") \
        if has_row_slice(split) else rows


def is_json_lines(name_or_path: Any) -> bool:
    """Whether ``name_or_path`` names a JSON Lines file (.jsonl): the only kind whose malformed lines can be
    skipped (:func:`well_formed_lines`)."""
    return str(name_or_path).lower().endswith(".jsonl")


@contextmanager
def well_formed_lines(path: Path, key: str) -> Iterator[Path]:
    """``path``, or (when some of its lines are not JSON objects) a temporary copy without them, said on stderr
    with their count and the first; upstream's ``skip_invalid_samples`` for a JSON Lines file. A file whose every
    line is malformed is refused."""
    kept, malformed = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            malformed.append(f"line {number}, column {err.colno}: {err.msg}")
            continue
        if isinstance(row, dict):
            kept.append(line)
        else:
            malformed.append(f"line {number}: a JSON {type(row).__name__}, not an object")
    if not malformed:
        yield path
        return
    if not kept:
        raise AutomodelError(f"{key}: no line of '{path}' is a JSON object (the first: {malformed[0]})")
    if os.environ.get("RANK", "0") == "0":
        print(f"{key}: skipped {len(malformed)} malformed line(s) of '{path}' (the first: {malformed[0]})",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="automodel-jsonl-") as folder:
        copy = Path(folder) / path.name
        copy.write_text("\n".join(kept) + "\n", encoding="utf-8")
        yield copy


def has_row_slice(split: str | None) -> bool:
    """Whether ``split`` is one split with a row slice, written ``name[start:stop]`` (``[:64]``, ``[10%:]``)."""
    return _SLICED_SPLIT.match(split or "") is not None


def select_row_slice(rows: Any, split: str, key: str, where: str) -> Any:
    """The rows that ``split``'s row slice selects of ``rows`` (read as ``datasets`` reads the slice, percentages
    included); refused, with the row count, when it selects none."""
    import datasets

    base = split.split("[", 1)[0]
    try:
        (span,) = datasets.ReadInstruction.from_spec(split).to_absolute({base: len(rows)})
    except (ValueError, AssertionError) as err:
        raise AutomodelError(f"{key.rsplit('.', 1)[0]}.split: '{split}' is not a split with a row slice: {err}") \
            from None
    if span.from_ >= span.to:
        raise AutomodelError(f"{key.rsplit('.', 1)[0]}.split: '{split}' selects none of the {len(rows)} rows of "
                             f"{where}; give a slice within them")
    return rows.select(range(span.from_, span.to))


def json_problem(path: Path) -> str | None:
    """Where a JSON or JSON Lines file is malformed (``line 7, column 12: Expecting ',' delimiter``), or None.

    Only called after ``datasets`` failed to read the file, whose errors do not say where.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        return None
    try:
        json.loads(lines[0][1])
        one_document = False
    except json.JSONDecodeError:
        one_document = True  # a pretty-printed .json document, not JSON Lines
    if one_document:
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f"line {err.lineno}, column {err.colno}: malformed JSON: {err.msg}"
        return None
    for number, line in lines:
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            return f"line {number}, column {err.colno}: malformed JSON: {err.msg}"
    return None


class BadRows:
    """What a data set does with a row that lacks a required field (absent or null) or holds an unusable value.

    ``on_bad_row: error`` (the default) stops with the file, the row (counted from 1) and the field; ``skip``
    leaves such rows out, and :meth:`report` says how many (and the first) once the data set is read.
    """

    def __init__(self, on_bad_row: str, source: str, key: str = "dataset"):
        if on_bad_row not in ("error", "skip"):
            raise AutomodelError(f"{key}.on_bad_row: expected 'error' or 'skip', found {on_bad_row!r}")
        self.skip, self.source, self.key = on_bad_row == "skip", source, key
        self.skipped: list[str] = []

    def bad(self, index: int, problem: str) -> None:
        """Row ``index`` (0-based) is bad: raise, or count it when skipping."""
        where = f"row {index + 1} of '{self.source}'"
        if not self.skip:
            raise AutomodelError(f"{self.key}: {where}: {problem}; fix the row, or set {self.key}.on_bad_row: skip "
                                 "to leave such rows out")
        self.skipped.append(f"{where}: {problem}")

    def missing(self, index: int, row: dict[str, Any], fields: Iterable[str]) -> bool:
        """Whether a required field of the row is absent or null (then :meth:`bad` has been called)."""
        for field in fields:
            if row.get(field) is None:
                self.bad(index, f"the field '{field}' is missing or null")
                return True
        return False

    def report(self) -> None:
        if self.skipped and os.environ.get("RANK", "0") == "0":
            print(f"{self.key}: skipped {len(self.skipped)} bad row(s) (on_bad_row: skip); the first: "
                  f"{self.skipped[0]}", file=sys.stderr)
