"""Did-you-mean suggestions shared by config validation, targets and the CLI."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def _edits(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and adjacent swaps."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, start=1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to ``name``, or None when nothing is close.

    difflib finds the close candidates; among them the one fewest edits away wins, then the one of the closest
    length (difflib alone prefers ``Adam`` over ``AdamW`` for ``AdamX``), then difflib's own order.
    """
    matches = difflib.get_close_matches(name, list(candidates), n=5, cutoff=0.6)
    if not matches:
        return None
    return min(matches, key=lambda m: (_edits(name.lower(), m.lower()), abs(len(m) - len(name)), matches.index(m)))
