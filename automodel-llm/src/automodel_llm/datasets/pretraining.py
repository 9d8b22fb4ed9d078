"""Pre-training text: a ``text`` column tokenized, joined with EOS and cut into fixed-length blocks."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError, ConfigIssue
from automodel_llm.datasets.arguments import ALIASES, ARGUMENT_HELP, given, read_rows

MOCK_END_ID = 1  # upstream's mock vocabulary: 0 padding, 1 end of sentence, the rest words


class PretrainingTextDataset(Dataset):
    """A text column tokenized, joined with EOS and cut into blocks of ``seq_length`` tokens; every token is a
    label. The tail shorter than a block is dropped.

    A row whose text is null or not text is refused, or skipped with ``on_bad_row: skip``; empty text adds nothing.
    """

    argument_aliases = ALIASES
    argument_help = {**ARGUMENT_HELP, "seq_length": "tokens per block (default 512)",
                     "text_column": "the column holding the text"}

    def __init__(self, path_or_dataset_id: str | None = None, split: str = "train", name: str | None = None,
                 tokenizer: Any = None, seq_length: int | None = None, text_column: str = "text",
                 limit_dataset_samples: int | None = None, shuffle_seed: int | None = None,
                 on_bad_row: OnBadRow = "error", dataset_name: str | None = None,
                 max_seq_length: int | None = None):
        source = given("path_or_dataset_id", path_or_dataset_id, "dataset_name", dataset_name)
        block = given("seq_length", seq_length, "max_seq_length", max_seq_length, 512)
        if tokenizer is None:
            raise AutomodelError("dataset: PretrainingTextDataset needs a tokenizer (tokenizer: section)")
        rows = read_rows(source, split, name, shuffle_seed, limit_dataset_samples)
        if text_column not in rows.column_names:
            raise AutomodelError(f"dataset.text_column: '{source.value}' has no column '{text_column}' "
                                 f"(found: {', '.join(rows.column_names)})")
        stream: list[int] = []
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        bad_rows = BadRows(on_bad_row, source.value)
        for index, text in enumerate(rows[text_column]):
            if not isinstance(text, str):
                bad_rows.bad(index, f"the field '{text_column}' is " + ("null" if text is None else "not text"))
            elif text:
                stream += tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        bad_rows.report()
        count = len(stream) // block.value
        if count == 0:
            raise AutomodelError(f"{source.key}: '{source.value}' has {len(stream)} tokens, fewer than one block of "
                                 f"{block.key}={block.value}")
        self.blocks = torch.tensor(stream[: count * block.value], dtype=torch.long).view(count, block.value)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        block = self.blocks[index].tolist()
        return {"input_ids": block, "labels": block}


class MockDataset(Dataset):
    """Random token sequences of ``seq_length`` tokens (default 128), for benchmarks (seeded, so runs are
    comparable)."""

    argument_aliases = {"max_seq_length": "seq_length"}
    argument_help = {"num_samples": "how many sequences", "seq_length": "tokens per sequence (default 128)",
                     "vocab_size": "token ids are drawn below it (default: the tokenizer's size)",
                     "seed": "the random generator's seed"}

    def __init__(self, num_samples: int = 1024, seq_length: int | None = None, vocab_size: int | None = None,
                 tokenizer: Any = None, seed: int = 0, max_seq_length: int | None = None):
        seq_length = given("seq_length", seq_length, "max_seq_length", max_seq_length, 128).value
        vocab = vocab_size or (len(tokenizer) if tokenizer is not None else None)
        if not vocab:
            raise AutomodelError("dataset.vocab_size: needed when no tokenizer is available")
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        """Sample ``index``, drawn when asked (a million samples cost nothing until read), the same every time."""
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        row = torch.randint(0, self.vocab_size, (self.seq_length,), generator=generator).tolist()
        return {"input_ids": row, "labels": row}


class MockSentencesDataset(Dataset):
    """Upstream's ``build_unpacked_dataset`` (its ``llm.mock``): ``num_sentences`` random sentences of varying length,
    each ``round(gauss(mean_len, std_len))`` tokens (kept within 1 .. ``max_sentence_len``) drawn from ids 2 ..
    ``vocab_size - 1``, then the end-of-sentence id 1 (id 0 is padding), seeded; every token is a label. Upstream
    passes it a tokenizer and ignores it, as this does: the sentences are token ids already."""

    argument_help = {"num_sentences": "how many sentences (default 10)",
                     "mean_len": "the sentences' mean length in tokens, before the end token (default 20)",
                     "std_len": "the standard deviation of their lengths (default 6; 0: all mean_len)",
                     "vocab_size": "token ids are drawn below it (ids 0 and 1 are padding and the end token)",
                     "max_sentence_len": "the longest sentence, before the end token (default 64)",
                     "seed": "the random generator's seed"}
    pretokenized = True

    def __init__(self, num_sentences: int = 10, mean_len: float = 20.0, std_len: float = 6.0, vocab_size: int = 100,
                 max_sentence_len: int = 64, seed: int = 0, tokenizer: Any = None):
        for key, value, least in (("num_sentences", num_sentences, 1), ("vocab_size", vocab_size, 3),
                                  ("max_sentence_len", max_sentence_len, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise AutomodelError(f"dataset.{key}: expected a whole number >= {least}, found {value!r}")
        if std_len < 0:
            raise AutomodelError(f"dataset.std_len: expected a number >= 0, found {std_len!r}")
        draw = random.Random(seed)
        self.sentences = []
        for _ in range(num_sentences):
            length = max(1, min(max_sentence_len, int(draw.gauss(mean_len, std_len))))
            self.sentences.append([draw.randrange(2, vocab_size) for _ in range(length)] + [MOCK_END_ID])

    def __len__(self) -> int:
        return len(self.sentences)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        sentence = self.sentences[index]
        return {"input_ids": sentence, "labels": sentence}


def mock_iterable_dataset(vocab_size: int = 1024, seq_len: int = 1024, num_samples: int = 1_000_000,
                          batch_size: int | None = None) -> MockDataset:
    """Upstream's ``MockIterableDataset``: ``num_samples`` random sequences of ``seq_len`` tokens below
    ``vocab_size``, the loss on every token after the first. Upstream's data set yields whole batches of
    ``batch_size`` rows, which must match its step_scheduler.local_batch_size; here the dataloader forms the
    batches, of the run's rows per micro-batch, so ``batch_size`` is that number (validation checks it:
    :func:`batch_size_issues`) or null."""
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise AutomodelError(f"dataset.batch_size: expected a whole number >= 1 or null, found {batch_size!r}")
    return MockDataset(num_samples=num_samples, seq_length=seq_len, vocab_size=vocab_size)


def batch_size_issues(sections: list[tuple[str, Any, Any]], rows: int) -> list[ConfigIssue]:
    """A MockIterableDataset section whose ``batch_size`` is not the run's rows per micro-batch ``rows``
    (``sections``: ``(key, node, callable)`` of the data set sections)."""
    return [ConfigIssue(f"{key}.batch_size", f"{node['batch_size']} differs from the run's rows per micro-batch "
                                             f"({rows}: dataloader.batch_size, else step_scheduler.local_batch_size); "
                                             "upstream requires the two to match: make them equal or remove it")
            for key, node, fn in sections
            if fn is mock_iterable_dataset and node.get("batch_size") not in (None, rows)]


def drawn_vocab_issues(sections: list[tuple[str, Any, Any]], model_vocab: int | None) -> list[ConfigIssue]:
    """A random-token section (MockIterableDataset) drawing ids the model has no embedding row for: its
    ``vocab_size`` (upstream's default 1024 when unset) above the model's ``model_vocab``."""
    import inspect

    issues = []
    for key, node, fn in sections:
        if fn is not mock_iterable_dataset or not isinstance(model_vocab, int):
            continue
        drawn = node.get("vocab_size") or inspect.signature(fn).parameters["vocab_size"].default
        if isinstance(drawn, int) and drawn > model_vocab:
            unset = " (unset)" if node.get("vocab_size") is None else ""
            issues.append(ConfigIssue(f"{key}.vocab_size", f"{drawn}{unset}: token ids are drawn below it, but the "
                                      f"model's vocabulary has {model_vocab} (its config's vocab_size), so ids past "
                                      f"it have no embedding; set it to at most {model_vocab}"))
    return issues


def position_table_issues(sections: list[tuple[str, Any, Any]], config: Any) -> list[ConfigIssue]:
    """A MegatronPretraining or NanogptDataset section whose samples feed the model more tokens (``seq_length`` /
    ``seq_len``: the labels are the next tokens, pre-shifted) than the learned position table of ``config``'s
    model has rows (GPT-2's ``n_positions``); rotary models have no such table."""
    from automodel_llm.datasets.megatron import MegatronPretraining
    from automodel_llm.datasets.nanogpt import NanogptDataset

    limit = getattr(config, "n_positions", None)
    lengths = {MegatronPretraining: ("seq_length", 2048), NanogptDataset: ("seq_len", None)}  # key, its default
    issues = []
    for key, node, fn in sections:
        name, default = lengths.get(fn, (None, None))
        length = node.get(name) or default if name is not None else None
        if isinstance(limit, int) and isinstance(length, int) and length > limit:
            issues.append(ConfigIssue(f"{key}.{name}", f"{length}: each sample feeds the model {length} tokens, but "
                                      f"its learned positions stop at n_positions = {limit}; set {name} to at most "
                                      f"{limit}"))
    return issues


def label_form_issues(sections: list[tuple[str, Any, Any]]) -> list[ConfigIssue]:
    """Validation sections whose labels take the other form than the training section's: pre-shifted (the data
    set's ``labels_shifted``, the next tokens already) against the input tokens themselves (the loss shifts them);
    a run computes its loss one way."""
    from automodel.training.next_token import shifted_mismatch

    train = next((fn for key, _, fn in sections if key == "dataset"), None)
    if train is None:
        return []
    want = bool(getattr(train, "labels_shifted", False))
    issues = []
    for key, _, fn in sections:
        if key != "dataset" and bool(getattr(fn, "labels_shifted", False)) != want:
            names = [getattr(f, "__name__", str(f)) for f in ((train, fn) if want else (fn, train))]
            issues.append(ConfigIssue(f"{key}._target_", shifted_mismatch(*names)))
    return issues


mock_iterable_dataset.argument_help = {"vocab_size": "token ids are drawn below it", "seq_len": "tokens per sample",
                                       "num_samples": "how many samples",
                                       "batch_size": "the run's rows per micro-batch, or null (the dataloader "
                                                     "forms the batches)"}
mock_iterable_dataset.pretokenized = True  # random token ids below vocab_size: a run on them needs no tokenizer
