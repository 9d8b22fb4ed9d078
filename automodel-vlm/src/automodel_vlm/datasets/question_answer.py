"""Upstream's VLM data set factories for fixed-schema image data sets, on our conversation data set.

Each reads rows of one image and its text (a hub data set, or a local JSONL / JSON / parquet file or folder with
the same columns) and makes the one-turn conversation upstream's factory makes: the user gives the image and a
question (a fixed prompt where the data set has none), the assistant answers. The samples are those of
:class:`~automodel_vlm.datasets.ImageTextChatDataset` (``{messages, images}``), so the VLM recipe's collation
and loss apply unchanged.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from automodel.data import OnBadRow
from automodel.errors import AutomodelError
from automodel_vlm.datasets.conversation import ImageTextChatDataset, load_conversation_rows

DESCRIBE = "Describe this image."
PRODUCT_CATEGORY = "Which product category is this item in?"
_SLICE = re.compile(r"^(\w+)\[:(\d+)\]$")


def _conversation(question: str, answer: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def _rows(path_or_dataset: str, split: str, key: str, columns: tuple[str, ...], field: str = "path_or_dataset"
          ) -> tuple[Any, Any, int | None]:
    """(rows, their folder, a row limit): ``split`` may be ``name[:N]`` (the first N rows), as upstream allows;
    errors name ``key.field``."""
    limit = None
    match = _SLICE.match(split)
    if match:
        split, limit = match.group(1), int(match.group(2))
    rows, folder = load_conversation_rows(path_or_dataset, split, f"{key}.{field}")
    missing = [c for c in columns if c not in rows.column_names]
    if missing:
        raise AutomodelError(f"{key}.{field}: '{path_or_dataset}' has no column {', '.join(missing)} (it "
                             f"has: {', '.join(rows.column_names)}); this factory reads {', '.join(columns)}")
    return rows, folder, limit


def _capped(limit: int | None, cap: int | None) -> int | None:
    """The row limit of a ``split`` slice and ``limit_dataset_samples`` together (None: every row)."""
    return cap if limit is None else limit if cap is None else min(limit, cap)


def _dataset(rows: Any, folder: Any, source: str, key: str, image_column: str, limit: int | None,
             on_bad_row: OnBadRow, messages: Any, text_columns: list[str]) -> ImageTextChatDataset:
    """Rows plus a ``messages`` column made from their text columns (images stay as they are, undecoded)."""
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    rows = rows.map(lambda *texts: {"messages": json.dumps(messages(*texts))}, input_columns=text_columns,
                    remove_columns=text_columns)
    return ImageTextChatDataset.from_rows(rows, folder, source, config_key=key, image_column=image_column,
                                          on_bad_row=on_bad_row)


def make_medpix_dataset(path_or_dataset: str = "medpix-dataset/medpix-dataset", split: str = "train",
                        config_key: str = "dataset", on_bad_row: OnBadRow = "error") -> ImageTextChatDataset:
    """MedPix VQA rows ``{image_id: image, question, answer}``: the user asks the question about the image."""
    rows, folder, limit = _rows(path_or_dataset, split, config_key, ("image_id", "question", "answer"))
    return _dataset(rows, folder, str(path_or_dataset), config_key, "image_id", limit, on_bad_row, _conversation,
                    ["question", "answer"])


def make_rdr_dataset(path_or_dataset: str = "quintend/rdr-items", split: str = "train",
                     config_key: str = "dataset", on_bad_row: OnBadRow = "error") -> ImageTextChatDataset:
    """RDR rows ``{image, text}``: the user asks "Describe this image.", the assistant gives the text."""
    rows, folder, limit = _rows(path_or_dataset, split, config_key, ("image", "text"))
    return _dataset(rows, folder, str(path_or_dataset), config_key, "image", limit, on_bad_row,
                    lambda text: _conversation(DESCRIBE, text), ["text"])


def make_cord_v2_dataset(path_or_dataset: str = "naver-clova-ix/cord-v2", split: str = "train",
                         limit_dataset_samples: int | None = None, config_key: str = "dataset",
                         on_bad_row: OnBadRow = "error") -> ImageTextChatDataset:
    """CORD-v2 receipts ``{image, ground_truth}``: the answer is the ground truth's parse as tokens
    (``<s_key>value</s_key>``, keys in reverse order, list items joined by ``<sep/>``); where it holds several
    parses (``gt_parses``) one is drawn with Python's RNG (seeded by the run)."""
    rows, folder, limit = _rows(path_or_dataset, split, config_key, ("image", "ground_truth"))
    limit = _capped(limit, limit_dataset_samples)
    return _dataset(rows, folder, str(path_or_dataset), config_key, "image", limit, on_bad_row,
                    lambda truth: _conversation(DESCRIBE, receipt_tokens(truth, config_key)), ["ground_truth"])


def make_shopify_product_catalogue_dataset(path_or_dataset: str = "Shopify/product-catalogue", split: str = "train",
                                           limit_dataset_samples: int | None = None, prompt: str = PRODUCT_CATEGORY,
                                           config_key: str = "dataset", on_bad_row: OnBadRow = "error"
                                           ) -> ImageTextChatDataset:
    """Shopify product-catalogue rows ``{product_image, ground_truth_category}``: the user shows the product photo
    and asks ``prompt`` (its category), the assistant answers with the taxonomy category."""
    rows, folder, limit = _rows(path_or_dataset, split, config_key, ("product_image", "ground_truth_category"))
    limit = _capped(limit, limit_dataset_samples)
    return _dataset(rows, folder, str(path_or_dataset), config_key, "product_image", limit, on_bad_row,
                    lambda category: _conversation(prompt, category), ["ground_truth_category"])


def receipt_tokens(ground_truth: str, key: str = "dataset") -> str:
    """One parse of a CORD-style ``ground_truth`` JSON string as a token sequence."""
    try:
        truth = json.loads(ground_truth)
    except (TypeError, json.JSONDecodeError) as err:
        raise AutomodelError(f"{key}: a ground_truth is not JSON: {err}") from None
    parses = truth.get("gt_parses") if isinstance(truth, dict) else None
    if parses is None:
        parse = truth.get("gt_parse") if isinstance(truth, dict) else None
        if not isinstance(parse, dict):
            raise AutomodelError(f"{key}: a ground_truth has neither gt_parses (a list) nor gt_parse (a mapping)")
        parses = [parse]
    return random.choice([json_tokens(parse) for parse in parses])


def json_tokens(value: Any) -> str:
    """A JSON value as tokens: a mapping -> ``<s_k>v</s_k>`` per key (reverse-sorted), a list -> items joined by
    ``<sep/>``, a lone ``text_sequence`` -> its text, anything else -> its string."""
    if isinstance(value, dict):
        if list(value) == ["text_sequence"]:
            return value["text_sequence"]
        return "".join(f"<s_{k}>{json_tokens(value[k])}</s_{k}>" for k in sorted(value, reverse=True))
    if isinstance(value, list):
        return "<sep/>".join(json_tokens(item) for item in value)
    return str(value)
