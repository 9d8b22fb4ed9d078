"""The bench's table: one row per figure, its target and verdict, printed at the end and saved with the raw data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stats import pair_ratios, ratio


@dataclass
class Row:
    bench: str
    metric: str
    automodel: str
    baseline: str
    ratio: float | None
    target: str = ""
    verdict: str = "info"
    note: str = ""


def check(value: float | None, op: str, limit: float) -> str:
    if value is None:
        return "n/a"
    ok = value >= limit if op == ">=" else value <= limit
    return "pass" if ok else "FAIL"


def fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def print_table(rows: list[Row]) -> None:
    headers = ["#", "benchmark", "automodel", "baseline", "ratio", "target", "verdict"]
    body = [[r.bench, r.metric, r.automodel, r.baseline, "-" if r.ratio is None else f"{r.ratio:.3f}", r.target,
             r.verdict] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *body, strict=False)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False))
    print(line)
    print("-" * len(line))
    for cells in body:
        print("  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)))
    notes = [f"  {r.bench} {r.metric}: {r.note}" for r in rows if r.note]
    if notes:
        print("\nnotes:")
        print("\n".join(notes))


def throughput_rows(rows: list[Row], bench: str, label: str, summary: dict[str, Any], other: str,
                    target: float) -> dict[str, Any]:
    """Two rows: tokens per wall second (what a user waits for) and per CPU second of the training process
    (what the framework itself costs; on a shared machine far less noisy than wall time)."""
    sides = summary["sides"]
    name = {"hand": "hand", "trainer": "Trainer"}[other]
    out = {}
    for key, unit in (("tokens_per_s", "tokens/s"), ("tokens_per_cpu_s", "tokens/CPU-s")):
        a, b = sides["automodel"][f"median_{key}"], sides[other][f"median_{key}"]
        r = ratio(a, b)
        pairs = pair_ratios(summary, "automodel", other, key)
        spread = [p for p in pairs if p is not None]
        note = (f"n={summary['reps']}; per-repetition ratios {', '.join(f'{p:.3f}' for p in spread)}"
                if len(spread) > 1 else f"n={summary['reps']}")
        if key == "tokens_per_s":
            note += (f"; CPU share of wall: automodel {fmt(sides['automodel']['median_cpu_share'], '', 2)}, "
                     f"{name} {fmt(sides[other]['median_cpu_share'], '', 2)}")
        rows.append(Row(bench, f"{unit}, {label}", fmt(a), f"{fmt(b)} {name}", r, f">= {target}",
                        check(r, ">=", target), note))
        out[key] = {"ratio": r, "pairs": pairs}
    return out


def flag_batches(rows: list[Row], summary: dict[str, Any]) -> None:
    for side, data in summary["sides"].items():
        if data["errors"]:
            rows[-1].note += f" {side} errors: {data['errors'][0][:300]}"
        if data["mismatched_batches"]:
            rows[-1].note += (f" {side}: warm-up losses differ from the hand loop's (not the same model, data or "
                              "optimizer: the comparison is not like for like).")
