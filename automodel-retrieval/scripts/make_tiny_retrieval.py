#!/usr/bin/env python
"""Generate the tiny retrieval example data: invented countries and facts about them.

Every name is made up here from syllable lists (no third-party text). Each of ``--countries`` countries gets six
facts (capital, language, export, currency, river, ruler), each one short document; the queries ask for one fact
of one country in words that differ from the document's (query "capital of Zorvia" <-> document "Zorvia's
capital city is Kell, ..."). What a model must learn is which query wording asks for which kind of fact, and to
match the country's name.

(country, fact) pairs are split: the validation queries ask about pairs no training query asks about, so a
rising validation recall means the model generalised (it has seen the country and the fact type, never the two
together). Rows are ``{"query", "positive", "negatives"}`` with three hard negatives (other facts of the same
country, the same fact of another country); no training row mentions a held-out document, not even as a
negative.

Files (``--out``, default the package's ``examples/assets/tiny_retrieval``)::

    train.jsonl        one row per (pair, query wording) of the training pairs
    validation.jsonl   one row per (pair, query wording) of the held-out pairs
    corpus.jsonl       {"id", "text"}: every document (what validation retrieves from)

Usage::

    python automodel-retrieval/scripts/make_tiny_retrieval.py
    python automodel-retrieval/scripts/train_tiny_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src/automodel_retrieval/examples/assets/tiny_retrieval"

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr", "vel",
          "zor", "qu", "th"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "eo", "ou"]
CODAS = ["", "n", "r", "l", "s", "m", "k", "th"]
COUNTRY_ENDS = ["ia", "and", "ora", "esh", "istan", "ovia", "ene", "ar"]
CITY_ENDS = ["ell", "ford", "holm", "ton", "grad", "mouth", "wick", "by"]
LANGUAGE_ENDS = ["ish", "ese", "ic", "ian"]
RIVER_ENDS = ["wa", "ine", "ube", "ada"]
GOODS = ["copper", "wool", "salt", "timber", "silk", "tea", "glass", "honey", "iron", "pepper", "cotton", "marble",
         "amber", "rice", "tin", "leather", "pearls", "olives", "barley", "rope", "clocks", "paper", "wine", "furs",
         "dyes", "coal", "spices", "soap", "apples", "lamps"]
COINS = ["crown", "mark", "shell", "bead", "florin", "penny"]
TITLES = ["Queen", "King", "Duke", "Duchess", "Chancellor", "Regent"]

# fact -> (document template, [query wordings]); {c} the country, {x} the fact's value.
FACTS = {
    "capital": ("{c}'s capital city is {x}, home to its royal court.",
                ["capital of {c}", "which city is the seat of government of {c}"]),
    "language": ("The people of {c} speak {x} at home and at school.",
                 ["language of {c}", "what tongue do folk in {c} talk in"]),
    "export": ("{c} mainly ships {x} to its neighbours by cart and boat.",
               ["main export of {c}", "what goods does {c} sell abroad"]),
    "currency": ("Shops in {c} take payment in the {x}.",
                 ["currency of {c}", "what money is used in {c}"]),
    "river": ("The longest river flowing through {c} is the {x}.",
              ["biggest stream of {c}", "which waterway crosses {c}"]),
    "ruler": ("{c} is governed by {x}, who was crowned last spring.",
              ["ruler of {c}", "who reigns over {c}"]),
}


def make_names(rng: random.Random, count: int, ends: list[str], taken: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        stem = rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
        name = (stem + rng.choice(ends)).capitalize()
        if name not in taken and 4 <= len(name) <= 10:
            taken.add(name)
            names.append(name)
    return names


def generate(countries: int, validation_fraction: float, seed: int) -> tuple[list[dict], list[dict], list[str]]:
    rng = random.Random(seed)
    taken: set[str] = set()
    names = make_names(rng, countries, COUNTRY_ENDS, taken)
    cities = make_names(rng, countries, CITY_ENDS, taken)
    languages = make_names(rng, countries, LANGUAGE_ENDS, taken)
    rivers = make_names(rng, countries, RIVER_ENDS, taken)
    people = make_names(rng, countries, [""], taken)
    coins = make_names(rng, countries, [""], taken)
    goods = [rng.choice(GOODS) for _ in range(countries)]
    values = {
        "capital": cities, "language": languages, "export": goods, "river": [f"{r} river" for r in rivers],
        "currency": [f"{c.lower()} {rng.choice(COINS)}" for c in coins],
        "ruler": [f"{rng.choice(TITLES)} {p}" for p in people],
    }
    docs = {(i, fact): FACTS[fact][0].format(c=names[i], x=values[fact][i])
            for i in range(countries) for fact in FACTS}
    corpus = list(docs.values())
    pairs = list(docs)  # insertion order: deterministic
    rng.shuffle(pairs)
    held_out = set(pairs[: round(len(pairs) * validation_fraction)])

    def negatives(i: int, fact: str, pool: set[tuple[int, str]]) -> list[str]:
        """Three hard negatives from ``pool``: other facts of the same country first, then the same fact of
        other countries, then anything."""
        ordered = sorted(pool, key=lambda p: (p[0], list(FACTS).index(p[1])))  # sets iterate in hash order
        same_country = [p for p in ordered if p[0] == i and p[1] != fact]
        same_fact = [p for p in ordered if p[1] == fact and p[0] != i]
        rest = [p for p in ordered if p[0] != i and p[1] != fact]
        rng.shuffle(same_country)
        rng.shuffle(same_fact)
        rng.shuffle(rest)
        chosen = same_country[:2] + same_fact[:1]
        chosen += (same_fact[1:] + rest)[: 3 - len(chosen)]
        return [docs[p] for p in chosen]

    # No training row mentions a held-out document (not even as a negative), so a model cannot have learnt to
    # score the validation positives down; validation negatives are drawn like training ones, from every document.
    train_pool = set(docs) - held_out
    train, validation = [], []
    for i, fact in sorted(docs, key=lambda p: (p[0], list(FACTS).index(p[1]))):
        wordings = FACTS[fact][1]
        for wording in wordings:
            if (i, fact) in held_out:
                validation.append({"query": wording.format(c=names[i]), "positive": docs[(i, fact)],
                                   "negatives": negatives(i, fact, set(docs) - {(i, fact)})})
            else:
                train.append({"query": wording.format(c=names[i]), "positive": docs[(i, fact)],
                              "negatives": negatives(i, fact, train_pool)})
    rng.shuffle(train)
    return train, validation, corpus


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--countries", type=int, default=40)
    parser.add_argument("--validation-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    train, validation, corpus = generate(args.countries, args.validation_fraction, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "validation.jsonl", validation)
    write_jsonl(args.out / "corpus.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus)])
    print(f"wrote {len(train)} training rows, {len(validation)} validation rows and {len(corpus)} documents "
          f"to {args.out}")


if __name__ == "__main__":
    main()
