"""The arguments the LLM data sets share, under one set of names, and what each does: one place for all of them.

Upstream NeMo AutoModel's names are the canonical ones: ``path_or_dataset_id`` (a hub id, or a local file or
directory), ``seq_length`` (the token limit of a sample), ``name`` (a hub data set's subset), ``shuffle_seed``,
``truncation`` and ``padding`` (with upstream's values). The spellings some data sets used before,
``dataset_name`` and ``max_seq_length``, are aliases everywhere (``ALIASES``; each data set lists its own in
``argument_aliases``, which validation and docs/config-reference.md read). Giving both spellings of one argument
is a config error.

Validation checks the values of ``truncation``, ``padding`` and ``on_bad_row`` from their ``Literal`` types;
``argument_issues`` adds what a type cannot say. A data set built from Python checks the same, naming the same keys.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from automodel.chat_template import chat_template_problem
from automodel.data import has_row_slice, load_rows, select_row_slice
from automodel.errors import AutomodelError, ConfigIssue

IGNORE_INDEX = -100
ALIASES = {"dataset_name": "path_or_dataset_id", "max_seq_length": "seq_length"}
# what each shared argument does; each data set's ``argument_help`` adds its own (docs/config-reference.md)
ARGUMENT_HELP = {
    "path_or_dataset_id": "a hub data set id, or a local JSON/JSONL/CSV/parquet/text file or a directory of them, or a "
                          "list of those read one after the other",
    "split": "the split to read, with an optional row slice (train[:256], validation[10%:]); a single local file "
             "is its only split, whatever it is called, and a slice selects its rows",
    "name": "the subset (configuration) of a hub data set or data set directory",
    "seq_length": "token limit of a sample: a longer one is refused, or cut when truncation is on",
    "truncation": "cut samples longer than seq_length instead of refusing them (true, longest_first, only_first)",
    "padding": "max_length pads each sample to seq_length (padding is masked out of attention and loss); the "
               "other values leave padding to the collator, which pads each batch to its longest sample",
    "limit_dataset_samples": "use only the first N rows (after shuffling)",
    "shuffle_seed": "shuffle the rows with this seed before limit_dataset_samples and before a row slice of split "
                    "(upstream's: one seed over train[:N] and train[N:M] makes a random partition)",
    "on_bad_row": "error: a row missing a required field (or holding an unusable one) stops the run, naming the "
                  "file, row and field; skip: such rows are left out and counted",
}

Truncation = bool | Literal["do_not_truncate", "longest_first", "only_first"]
Padding = bool | Literal["do_not_pad", "longest", "max_length"]
_TRUNCATE = {True: True, "longest_first": True, "only_first": True, False: False, "do_not_truncate": False}
# pad each sample to seq_length, or leave it to the collator, which pads a batch to its longest sample
_PAD_TO_LENGTH = {"max_length": True, True: False, "longest": False, False: False, "do_not_pad": False}


@dataclass(frozen=True)
class Given:
    """An argument's value and the key the config gave it under (for errors)."""

    value: Any
    key: str


def given(name: str, value: Any, alias: str, alias_value: Any, default: Any = None) -> Given:
    """The argument given as ``name`` or as its ``alias``; both given is an error."""
    if alias_value is None:
        return Given(default if value is None else value, f"dataset.{name}")
    if value is not None:
        raise AutomodelError(f"dataset.{alias}: {both_spellings(name)}")
    return Given(alias_value, f"dataset.{alias}")


def both_spellings(name: str) -> str:
    return f"the same argument as {name}, which is also given; give only {name}"


# ---- value checks (shared by validation and the data sets) ---------------------------------------------------

PAD_WITHOUT_LENGTH = "max_length pads each sample to seq_length, which is not set; set seq_length"


def _choice_problem(value: Any, choices: Mapping[Any, bool]) -> str | None:
    if value is None or (isinstance(value, (bool, str)) and value in choices):
        return None
    return f"{value!r} is not one of true, false, {', '.join(k for k in choices if isinstance(k, str))}"


def raise_problems(problems: list[tuple[str, str]]) -> None:
    """Raise the first of a data set's ``argument_problems`` (validation reports them all, with the section's
    key)."""
    for name, problem in problems:
        raise AutomodelError(f"dataset.{name}: {problem}")


def _raise(key: str, problem: str | None) -> None:
    if problem is not None:
        raise AutomodelError(f"{key}: {problem}")


# ---- what the arguments do -----------------------------------------------------------------------------------

def read_rows(source: Given, split: str, name: str | None = None, shuffle_seed: int | None = None,
              limit: int | None = None, shuffle_key: str = "dataset.shuffle_seed", revision: str | None = None,
              skip_malformed_lines: bool = False) -> Any:
    """The rows of ``split`` of ``source`` (a hub id, a local file or directory, or a list of them read one after
    the other): ``name`` picks a hub data set's subset, ``revision`` its version; rows are shuffled with
    ``shuffle_seed`` before the first ``limit`` are kept (so a limited run sees a sample of the whole split). A row
    slice in ``split`` is taken over all the rows of a list, and after the shuffle (as upstream's ChatDataset takes
    it: a training ``train[:1024]`` and a validation ``train[1024:1152]`` with one seed are a random partition).
    ``skip_malformed_lines``: each source is a local JSON Lines file whose malformed lines are left out."""
    if not source.value:
        raise AutomodelError(f"{source.key}: missing (a hub id, or a local file or directory)")
    values = source.value if isinstance(source.value, list) else [source.value]
    if not all(isinstance(value, str) and value for value in values):
        raise AutomodelError(f"{source.key}: expected a hub id, a local file or directory, or a list of them")
    if name is not None and any(Path(value).is_file() for value in values):
        raise AutomodelError(f"dataset.name: '{name}' names a subset of a hub data set, but {source.key} is the "
                             f"file '{source.value}'; remove name")
    if shuffle_seed is not None and (isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int)):
        raise AutomodelError(f"{shuffle_key}: expected an integer, found {shuffle_seed!r}")
    slice_whole = has_row_slice(split) and (len(values) > 1 or shuffle_seed is not None)
    parts = [load_rows(value, split.split("[", 1)[0] if slice_whole else split, key=source.key, name=name,
                       revision=revision, skip_malformed_lines=skip_malformed_lines) for value in values]
    if len(parts) > 1:
        import datasets

        parts = [datasets.concatenate_datasets(parts)]
    rows = parts[0]
    if shuffle_seed is not None:
        rows = rows.shuffle(seed=shuffle_seed)
    if slice_whole:
        shuffled = f" (shuffled with seed {shuffle_seed})" if shuffle_seed is not None else ""
        rows = select_row_slice(rows, split, source.key, f"{source.value}{shuffled}")
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    return rows


@dataclass(frozen=True)
class SampleLength:
    """``seq_length`` with what ``truncation`` and ``padding`` make of a longer or shorter sample."""

    limit: Given
    truncation: Truncation | None = False
    padding: Padding | None = "do_not_pad"

    def __post_init__(self) -> None:
        _raise("dataset.truncation", _choice_problem(self.truncation, _TRUNCATE))
        _raise("dataset.padding", _choice_problem(self.padding, _PAD_TO_LENGTH))
        if self.padding == "max_length" and self.limit.value is None:
            _raise("dataset.padding", PAD_WITHOUT_LENGTH)

    def fit(self, ids: list[int], labels: list[int], pad_token_id: int | None, where: str,
            keep_end: bool = False) -> dict[str, list[int]]:
        """The sample, truncated (or refused when longer and truncation is off) and padded as asked.

        Truncation keeps the first ``seq_length`` tokens, or the last with ``keep_end`` (a tokenizer whose
        ``truncation_side`` is left). A sample padded here carries its ``attention_mask``, so the padding is
        neither attended to nor learned.
        """
        limit = self.limit.value
        if limit is not None and len(ids) > limit:
            if not _TRUNCATE.get(self.truncation, False):
                raise AutomodelError(f"{self.limit.key}: {where} has {len(ids)} tokens, more than {limit}; raise "
                                     "it or set dataset.truncation: true")
            kept = slice(len(ids) - limit, None) if keep_end else slice(limit)
            ids, labels = ids[kept], labels[kept]
        sample = {"input_ids": ids, "labels": labels}
        if _PAD_TO_LENGTH.get(self.padding, False) and len(ids) < limit:
            fill = limit - len(ids)
            sample = {"input_ids": ids + [pad_token_id or 0] * fill, "labels": labels + [IGNORE_INDEX] * fill,
                      "attention_mask": [1] * len(ids) + [0] * fill}
        return sample


def learns_nothing(labels: list[int]) -> bool:
    """No label left past the first token (a causal LM never predicts the first): nothing to train on."""
    return all(label == IGNORE_INDEX for label in labels[1:])


# ---- validation ----------------------------------------------------------------------------------------------

def argument_issues(node: Mapping[str, Any], key: str, fn: Callable) -> list[ConfigIssue]:
    """What validation refuses in a data set section built by ``fn`` beyond the types of its arguments: both
    spellings of one argument, padding to a length that is not set, a chat template that is neither, and what the
    data set's own ``argument_problems(arguments)`` finds."""
    aliases = getattr(fn, "argument_aliases", {})
    issues = [ConfigIssue(f"{key}.{alias}", both_spellings(name)) for alias, name in aliases.items()
              if node.get(alias) is not None and node.get(name) is not None]
    accepted = _parameters(fn)
    if "padding" in accepted and node.get("padding") == "max_length" and \
            node.get("seq_length", node.get("max_seq_length")) is None:
        issues.append(ConfigIssue(f"{key}.padding", PAD_WITHOUT_LENGTH))
    problem = chat_template_problem(node.get("chat_template")) if "chat_template" in accepted else None
    if problem is not None:
        issues.append(ConfigIssue(f"{key}.chat_template", problem))
    own = getattr(fn, "argument_problems", None)  # what a data set's arguments cannot do together
    if own is not None:
        issues += [ConfigIssue(f"{key}.{name}", problem) for name, problem in own(node)]
    return issues


def _parameters(fn: Callable) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
