#!/usr/bin/env python
"""Generate the tiny sentence-pair classification example data set (``llm/tiny_seq_cls``).

Each row pairs a context of invented facts (the tiny SQuAD example's sentences: make_tiny_squad.py, whose word lists
this reuses) with a one-sentence claim about one of its people; the label says whether the context supports the
claim (1) or states another value for it (0), half and half::

    {"context": "Bren keeps a cat.", "claim": "Bren keeps a dog.", "label": 0}

With one fact per context (the default) the example's 2-layer BERT reaches about 0.9 validation accuracy in 300
steps on two CPU cores; with two or more it needs many more rows and steps. Everything is invented by the project.
No validation pair occurs in train. Deterministic for a ``--seed``.

Usage::

    python scripts/make_tiny_claims.py            # writes the default location
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from make_tiny_squad import FACTS, PEOPLE, write_splits

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "automodel-llm/src/automodel_llm/examples/assets/tiny_claims"


def make_row(rng: random.Random, n_facts: int) -> dict:
    kinds = rng.sample(FACTS, n_facts)
    people = rng.sample(PEOPLE, n_facts)
    facts = [(fact, person, rng.choice(fact.values)) for fact, person in zip(kinds, people, strict=True)]
    context = " ".join(f"{person}{fact.verb}{value}." for fact, person, value in facts)
    fact, person, value = rng.choice(facts)
    supported = rng.random() < 0.5
    claimed = value if supported else rng.choice([v for v in fact.values if v != value])
    return {"context": context, "claim": f"{person}{fact.verb}{claimed}.", "label": int(supported)}


def generate(n_train: int, n_validation: int, seed: int, n_facts: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    train = [make_row(rng, n_facts) for _ in range(n_train)]
    seen = {(row["context"], row["claim"]) for row in train}
    validation: list[dict] = []
    while len(validation) < n_validation:
        row = make_row(rng, n_facts)
        if (row["context"], row["claim"]) not in seen:  # fresh pairs only
            seen.add((row["context"], row["claim"]))
            validation.append(row)
    return train, validation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--train", type=int, default=800)
    parser.add_argument("--validation", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--facts", type=int, default=1, help="facts per context (1 to 4)")
    args = parser.parse_args()
    train, validation = generate(args.train, args.validation, args.seed, args.facts)
    write_splits(args.out, train, validation)


if __name__ == "__main__":
    main()
