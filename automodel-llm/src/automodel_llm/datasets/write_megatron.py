"""Tokenize JSONL text into Megatron's indexed ``<prefix>.bin`` / ``<prefix>.idx`` files (what Megatron-LM's
``tools/preprocess_data.py`` writes), so a run on ``MegatronPretraining`` can be prepared offline:

    python -m automodel_llm.datasets.write_megatron corpus.jsonl data/corpus_text_document --tokenizer NAME_OR_DIR
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from automodel.errors import AutomodelError
from automodel_llm.datasets.indexed import write_indexed


def jsonl_to_indexed(jsonl: str | Path, prefix: str | Path, tokenizer: Any, text_key: str = "text",
                     append_eod: bool = True) -> int:
    """Tokenize the ``text_key`` field of every line of ``jsonl`` (no special tokens; the tokenizer's EOS after
    each document with ``append_eod``, as Megatron's preprocess_data.py ``--append-eod``) into ``prefix``'s
    ``.bin`` / ``.idx``; returns the document count."""
    eod = [tokenizer.eos_token_id] if append_eod and tokenizer.eos_token_id is not None else []

    def documents() -> Iterable[list[int]]:
        with open(jsonl, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                text = json.loads(line).get(text_key)
                if not isinstance(text, str):
                    raise AutomodelError(f"{jsonl}:{number}: the field '{text_key}' is missing or not text")
                yield tokenizer(text, add_special_tokens=False)["input_ids"] + eod

    return write_indexed(prefix, documents(), np.uint16 if len(tokenizer) < 65536 else np.int32)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m automodel_llm.datasets.write_megatron JSONL PREFIX --tokenizer NAME_OR_DIR [--text-key text]``."""
    import argparse

    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description="Tokenize JSONL text into Megatron's <prefix>.bin / .idx")
    parser.add_argument("jsonl")
    parser.add_argument("prefix")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer name or directory")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--no-eod", action="store_true", help="do not end each document with the EOS token")
    args = parser.parse_args(argv)
    try:
        count = jsonl_to_indexed(args.jsonl, args.prefix, AutoTokenizer.from_pretrained(args.tokenizer),
                                 args.text_key, not args.no_eod)
    except (AutomodelError, OSError) as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {count} documents to {args.prefix}.bin / {args.prefix}.idx")


if __name__ == "__main__":
    main()
