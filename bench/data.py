"""Data the bench generates from tiny_squad: long samples (the sequence-length sweep) and variable-length samples
(packing), written only when their content changes so that the datasets cache stays valid."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from harness import TINY_SQUAD, TOKENIZER, WORK


def _tokenizer():
    from tokenizers import Tokenizer  # light (no torch); the same tokenizer.json the runs use

    return Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))


def _squad_len(tok: Any, context: str, question: str, answer: str) -> int:
    prompt = f"Context: {context} Question: {question} Answer:"
    return len(tok.encode(prompt).ids) + len(tok.encode(" " + answer, add_special_tokens=False).ids) + 1


def _write_if_changed(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:  # unchanged file: datasets cache hit
        path.write_text(text, encoding="utf-8")
    return path


def make_long_data(length: int, samples: int) -> Path:
    """SQuAD rows whose prompt is several tiny_squad contexts, each sample just under ``length`` tokens."""
    source = [json.loads(line) for line in (TINY_SQUAD / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    tok = _tokenizer()
    out, i = [], 0
    for n in range(samples):
        last = source[(i + n) % len(source)]
        contexts = [last["context"]]
        while True:
            extra = source[(i + len(contexts) * 7 + n) % len(source)]["context"]
            candidate = " ".join([extra] + contexts)
            if _squad_len(tok, candidate, last["question"], last["answers"]["text"][0]) > length - 2:
                break
            contexts.insert(0, extra)
        out.append({"context": " ".join(contexts), "question": last["question"], "answers": last["answers"]})
        i += len(contexts)
    return _write_if_changed(WORK / "data" / f"long_{length}.jsonl", out)


def make_variable_data(samples: int, max_len: int, shape: str) -> tuple[Path, list[int]]:
    """SQuAD rows whose prompt joins several tiny_squad contexts (~20 tokens each), so lengths vary.

    ``long_tail``: the number of contexts is 1 + a seeded lognormal(0, 0.9), up to 12: most samples are short and a
    few are several times longer, the shape of real SFT / QA data (mean ~56, median ~55, max ~216 tokens).
    ``narrow``: 1 to 5 contexts in turn, lengths spread evenly over ~35-116 tokens, where padding wastes least.
    """
    source = [json.loads(line) for line in (TINY_SQUAD / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    tok = _tokenizer()
    rng = random.Random(0)
    out, lengths = [], []
    for n in range(samples):
        if shape == "long_tail":
            k, stride = min(12, 1 + int(rng.lognormvariate(0.0, 0.9))), 13
        else:
            k, stride = 1 + (n * 7) % 5, 5
        rows = [source[(n * stride + j) % len(source)] for j in range(k)]
        last = rows[-1]
        while True:
            context = " ".join(r["context"] for r in rows)
            length = _squad_len(tok, context, last["question"], last["answers"]["text"][0])
            if length <= max_len or len(rows) == 1:
                break
            rows = rows[1:]
        out.append({"context": context, "question": last["question"], "answers": last["answers"]})
        lengths.append(length)
    return _write_if_changed(WORK / "data" / f"variable_{shape}_{samples}.jsonl", out), lengths
