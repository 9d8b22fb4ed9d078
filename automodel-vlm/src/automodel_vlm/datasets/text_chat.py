"""Upstream's text-only chat data for VLMs: Tulu-3 SFT conversations, alone or mixed with Magicoder problems.

A vision-language model keeps its language skills by training on text conversations too. The samples are those of
:class:`~automodel_vlm.datasets.ImageTextChatDataset` with no images (``{messages, images: []}``), so the VLM
recipe's collation renders them with the processor's chat template and labels the assistant turns only; a batch
may mix them with image samples.

Rows come from a hub data set or a local JSONL / JSON / parquet file or folder with the same columns: Tulu-3's
``messages`` (``{role, content}`` with string content), Magicoder's ``problem`` and ``solution``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from automodel.config import Config
from automodel.data import OnBadRow
from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.recipe_sections import data_sections
from automodel_vlm.datasets.conversation import ImageTextChatDataset
from automodel_vlm.datasets.question_answer import _dataset, _rows

TULU = "allenai/tulu-3-sft-mixture"
MAGICODER = "ise-uiuc/Magicoder-OSS-Instruct-75K"
ROLES = ("system", "user", "assistant")
# upstream's mix: Tulu-3 rows drawn with probability 0.8, Magicoder rows 0.2, until both are used up
MIX = (0.8, 0.2)
# upstream drops media placeholders it has no media for; text-only rows have none
_MEDIA = re.compile(r"<image>|<video>", re.IGNORECASE)
# Upstream's recipe-level keys of a dataset section (its pretokenizing wrapper reads them).
NO_FAKE_IMAGES = ("true: no fake image is added to text-only samples here (they train with no image); set false or "
                  "remove it")
TRUNCATE_NEEDS_PACKING = ("true: cuts the samples longer than packed_sequence.max_length when the training data is "
                          "packed, and {}; set false or remove it")


def _text(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}]


def tulu_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Upstream's conversion of a Tulu-3 conversation: system, user and assistant turns kept in order (other roles
    left out), user text stripped and without ``<image>`` / ``<video>`` placeholders."""
    out = []
    for message in messages or []:
        role, content = message.get("role"), message.get("content") or ""
        if role not in ROLES:
            continue
        if role == "user":
            parts = [_text(t.strip()) for t in _MEDIA.split(content) if t.strip()]
            out.append({"role": role, "content": [p for part in parts for p in part] or _text("")})
        else:
            out.append({"role": role, "content": _text(content)})
    return out


def make_tulu3_dataset(path_or_dataset: str = TULU, split: str = "train", truncate: bool = False,
                       inject_fake_images: bool = False, config_key: str = "dataset",
                       on_bad_row: OnBadRow = "error") -> ImageTextChatDataset:
    """Tulu-3 SFT rows ``{messages}`` as text-only conversations, every row in split order (``split: train[:N]``
    takes the first N). Upstream's recipe-level keys: ``truncate`` (packing cuts the samples longer than
    ``packed_sequence.max_length`` to it instead of leaving them out), ``inject_fake_images`` (false only)."""
    if inject_fake_images:
        raise AutomodelError(f"{config_key}.inject_fake_images: {NO_FAKE_IMAGES}")
    rows, folder, limit = _rows(path_or_dataset, split, config_key, ("messages",))
    dataset = _dataset(rows, folder, str(path_or_dataset), config_key, None, limit, on_bad_row, tulu_messages,
                       ["messages"])
    dataset.truncate = truncate
    return dataset


def _mix_tulu(messages: list[dict[str, Any]], max_turns: int) -> str:
    """The mix's Tulu-3 conversation as JSON, or "" for a row the mix leaves out: more than ``max_turns``
    messages, fewer than 2 non-empty turns, or no assistant turn."""
    if not messages or len(messages) > max_turns:
        return ""
    kept = [{"role": m.get("role"), "content": _text(m.get("content") or "")} for m in messages
            if m.get("role") in ROLES and (m.get("content") or "").strip()]
    if len(kept) < 2 or not any(m["role"] == "assistant" for m in kept):
        return ""
    return json.dumps(kept)


def _mix_magicoder(problem: str | None, solution: str | None) -> str:
    """A Magicoder problem and its solution as a two-turn conversation in JSON ("" if either is empty)."""
    problem, solution = (problem or "").strip(), (solution or "").strip()
    if not problem or not solution:
        return ""
    return json.dumps([{"role": "user", "content": _text(problem)}, {"role": "assistant", "content": _text(solution)}])


def make_tulu3_magicoder_text_mix_dataset(tulu_split: str = "train", magicoder_split: str = "train", seed: int = 42,
                                          max_turns: int = 16, limit_total: int | None = None,
                                          tulu_path_or_dataset: str = TULU,
                                          magicoder_path_or_dataset: str = MAGICODER,
                                          config_key: str = "dataset", on_bad_row: OnBadRow = "error"
                                          ) -> ImageTextChatDataset:
    """Upstream's text-only mix: Tulu-3 conversations of at most ``max_turns`` messages and Magicoder
    ``{problem, solution}`` pairs, interleaved at random (``seed``) 80/20 until every row of both was drawn (rows
    of the source used up first repeat), capped at ``limit_total`` rows. ``*_path_or_dataset`` (ours; upstream
    reads the hub sets) take a local file or folder with the same columns."""
    import datasets

    if max_turns < 2:
        raise AutomodelError(f"{config_key}.max_turns: {max_turns}: a conversation needs at least 2 turns")
    if limit_total is not None and limit_total < 1:
        raise AutomodelError(f"{config_key}.limit_total: {limit_total}: must be at least 1 (or remove it)")
    sources = []
    for field, path, split, columns, convert in (
            ("tulu_path_or_dataset", tulu_path_or_dataset, tulu_split, ("messages",),
             lambda messages: {"messages": _mix_tulu(messages, max_turns)}),
            ("magicoder_path_or_dataset", magicoder_path_or_dataset, magicoder_split, ("problem", "solution"),
             lambda problem, solution: {"messages": _mix_magicoder(problem, solution)})):
        rows, _, limit = _rows(path, split, config_key, columns, field)
        if limit is not None:
            rows = rows.select(range(min(limit, len(rows))))
        rows = rows.map(convert, input_columns=list(columns), remove_columns=rows.column_names)
        rows = rows.filter(lambda text: bool(text), input_columns=["messages"])
        if len(rows) == 0:
            raise AutomodelError(f"{config_key}.{field}: '{path}' has no usable conversation for the mix")
        sources.append(rows)
    mixed = datasets.interleave_datasets(sources, probabilities=list(MIX), seed=seed,
                                         stopping_strategy="all_exhausted")
    if limit_total is not None:
        mixed = mixed.select(range(min(limit_total, len(mixed))))
    return ImageTextChatDataset.from_rows(mixed, None, f"{tulu_path_or_dataset} + {magicoder_path_or_dataset}",
                                          config_key=config_key, image_column=None, on_bad_row=on_bad_row)


def text_chat_issues(cfg: Config) -> list[ConfigIssue]:
    """Upstream's recipe-level ``inject_fake_images: true`` in a data set section, and ``truncate: true`` where
    nothing is cut (a validation set, training data not packed or without ``packed_sequence.max_length``)."""
    packing = cfg.resolved.get("packed_sequence")
    max_length = packing.get("max_length") if isinstance(packing, dict) else None
    issues = []
    for key, section in data_sections(cfg).items():
        if section.get("inject_fake_images") is True:
            issues.append(ConfigIssue(f"{key}.inject_fake_images", NO_FAKE_IMAGES))
        if section.get("truncate") is not True:
            continue
        if key != "dataset":
            issues.append(ConfigIssue(f"{key}.truncate", TRUNCATE_NEEDS_PACKING.format("validation data is never "
                                                                                        "packed")))
        elif max_length is None:
            missing = "packed_sequence is not given" if packing is None else "packed_sequence.max_length is not set"
            issues.append(ConfigIssue(f"{key}.truncate", TRUNCATE_NEEDS_PACKING.format(missing)))
    return issues
