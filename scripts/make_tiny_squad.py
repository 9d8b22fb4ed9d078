#!/usr/bin/env python
"""Generate the tiny SQuAD-format question-answering example data set.

Everything here is invented by the project: the word lists below (person
names, towns, animals, work places, colours) are made up or plain words, and
the contexts are built from four fixed sentence templates.  No third-party
text is used.

Each context holds four facts about four different people, one fact of each
kind, always in the same order::

    Pella lives in Tolven. Bren keeps a cat. Mara works at the bakery. Tamsin wears white.

and each row asks one question whose one-word answer is a span of the context
("What town does Pella live in?" -> "Tolven", "What animal does Bren keep?" ->
"cat").  The fillers are drawn at random, so the answer can only be found by
reading the context (copying the right word); validation contexts are checked
not to occur in train, i.e. they are fresh combinations.

The task is deliberately easy so that a 2-layer, ~0.4M-parameter Llama learns
it to >= 0.9 exact match in well under a minute on two CPU cores: few, small
word lists, one answer slot per sentence, and a fixed sentence order (the
answer's position depends only on the kind of question).  ``--shuffle-facts``
and ``--who-questions`` make harder variants (shuffled order; "Who lives in
Tolven?"-style questions that need a relational look-up); in the tuning runs
(scripts/tune_tiny_squad.py, similar budgets) those reached only about 0.5-1.0
(seed dependent) and below 0.3 exact match respectively.

Usage::

    python scripts/make_tiny_squad.py            # writes the default location
    python scripts/make_tiny_squad.py --out DIR --train 800 --validation 100

The output is deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = (
    Path(__file__).resolve().parent.parent
    / "automodel-llm/src/automodel_llm/examples/assets/tiny_squad"
)

# Invented names (not meant to be real words).
PEOPLE = [
    "Mara", "Bren", "Ister", "Tovi", "Kael", "Dessa", "Orin", "Pella",
    "Ruvo", "Sanna", "Tamsin", "Ulko",
]
TOWNS = ["Tolven", "Marrow", "Kesta", "Dunmere", "Halvik", "Orrin", "Pasco", "Quenby"]
ANIMALS = ["fox", "cat", "dog", "goat", "owl", "hare", "crow", "mouse"]
PLACES = ["mill", "bakery", "harbour", "school", "market", "forge", "library", "farm"]
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "grey", "brown"]


class Fact:
    """One kind of fact: "<person><verb><value>." with a question asking for the value and one asking who."""

    def __init__(self, slot: str, values: list[str], verb: str, ask_value: str, ask_person: str):
        self.slot, self.values, self.verb = slot, values, verb
        self.ask_value, self.ask_person = ask_value, ask_person

    def __call__(self, person: str, rng: random.Random):
        value = rng.choice(self.values)
        # sentence pieces: (text, slot-name or None)
        pieces = [(person, "person"), (self.verb, None), (value, self.slot), (".", None)]
        questions = [(self.ask_value.format(person=person), self.slot),
                     (self.ask_person.format(value=value), "person")]
        return pieces, questions


FACTS = [
    Fact("town", TOWNS, " lives in ", "What town does {person} live in?", "Who lives in {value}?"),
    Fact("animal", ANIMALS, " keeps a ", "What animal does {person} keep?", "Who keeps a {value}?"),
    Fact("place", PLACES, " works at the ", "What place does {person} work at?", "Who works at the {value}?"),
    Fact("colour", COLOURS, " wears ", "What colour does {person} wear?", "Who wears {value}?"),
]


def make_row(
    rng: random.Random, idx: int, split: str, shuffle: bool = False, who: bool = False
) -> dict:
    people = rng.sample(PEOPLE, len(FACTS))
    facts = [make(p, rng) for make, p in zip(FACTS, people, strict=False)]
    order = list(range(len(facts)))
    if shuffle:
        rng.shuffle(order)

    # Build the context while remembering where every slot starts.
    context = ""
    spans = {}  # fact index -> {slot: (start, text)}
    for n, fi in enumerate(order):
        if n:
            context += " "
        pieces, _ = facts[fi]
        slots = {}
        for text, slot in pieces:
            if slot is not None:
                slots[slot] = (len(context), text)
            context += text
        spans[fi] = slots

    fi = rng.randrange(len(facts))
    questions = facts[fi][1]
    if not who:
        questions = [q for q in questions if q[1] != "person"]
    question, slot = rng.choice(questions)
    start, answer = spans[fi][slot]
    assert context[start : start + len(answer)] == answer
    return {
        "id": f"{split}-{idx:05d}",
        "title": "tiny_squad",
        "context": context,
        "question": question,
        "answers": {"text": [answer], "answer_start": [start]},
    }


def generate(
    n_train: int, n_validation: int, seed: int, shuffle: bool = False, who: bool = False
):
    rng = random.Random(seed)
    train, seen = [], set()
    while len(train) < n_train:
        row = make_row(rng, len(train), "train", shuffle, who)
        if row["context"] in seen:
            continue
        seen.add(row["context"])
        train.append(row)
    validation = []
    while len(validation) < n_validation:
        row = make_row(rng, len(validation), "validation", shuffle, who)
        if row["context"] in seen:  # fresh combinations only
            continue
        seen.add(row["context"])
        validation.append(row)
    return train, validation


def write_jsonl(path: Path, rows) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_splits(out: Path, train: list[dict], validation: list[dict]) -> None:
    """train.jsonl and validation.jsonl in ``out`` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "validation.jsonl", validation)
    print(f"wrote {len(train)} train / {len(validation)} validation rows to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--train", type=int, default=800)
    parser.add_argument("--validation", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--shuffle-facts", action="store_true",
                        help="shuffle the order of the facts in each context (harder)")
    parser.add_argument("--who-questions", action="store_true",
                        help="also ask 'Who lives in X?'-style questions (harder: needs a "
                        "relational look-up that the tiny example model does not learn quickly)")
    args = parser.parse_args()

    train, validation = generate(
        args.train, args.validation, args.seed, args.shuffle_facts, args.who_questions
    )
    write_splits(args.out, train, validation)


if __name__ == "__main__":
    main()
