"""Statistics of the bench's runs: throughput over step windows, repetitions of sides run together, medians and
ratios, padding efficiency and whole-epoch throughput."""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict
from typing import Any

from harness import Runner, Side


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def same_batches(run: dict[str, Any], reference: dict[str, Any], tolerance: float = 1e-4) -> bool:
    a, b = run.get("steps") or [], reference.get("steps") or []
    if not a or len(a) > len(b):
        return False
    return all(abs(x["loss"] - y["loss"]) <= tolerance * max(1.0, abs(y["loss"])) for x, y in zip(a, b, strict=False))


def step_tokens(run: dict[str, Any], reference: dict[str, Any] | None) -> tuple[list[float], str]:
    """Non-padding input tokens of each step. The baselines log them. For the CLI they are the hand loop's
    (exact) when the losses show both trained on the same batches; else estimated from the CLI's own tps x the
    time between its records (which leaves out its logging time, flattering it by about 1%)."""
    rows = run["steps"]
    if "tokens" in rows[0]:
        return [float(r["tokens"]) for r in rows], "logged"
    if reference is not None and same_batches(run, reference):
        return [float(r["tokens"]) for r in reference["steps"][:len(rows)]], "exact (same batches as hand loop)"
    estimates = [rows[0]["tps"] * (rows[0]["timestamp"] - run["t0"])]
    estimates += [b["tps"] * (b["timestamp"] - a["timestamp"]) for a, b in zip(rows, rows[1:], strict=False)]
    return estimates, "estimated (tps x interval)"


def window(run: dict[str, Any], tokens: list[float], lo: float, hi: float) -> dict[str, Any] | None:
    """tokens/s and tokens/CPU-s over the steps that end within [lo, hi] (wall-clock)."""
    rows = run["steps"]
    inside = [i for i, r in enumerate(rows) if lo - 1e-6 <= r["timestamp"] <= hi + 1e-6]
    if len(inside) < 3:
        return None
    a, b = inside[0], inside[-1]
    measured, seconds = sum(tokens[a + 1:b + 1]), rows[b]["timestamp"] - rows[a]["timestamp"]
    cpu = run.get("cpu_at_step", {})
    sa, sb = rows[a]["step"], rows[b]["step"]
    cpu_s = cpu[sb] - cpu[sa] if sa in cpu and sb in cpu else None
    return {"tokens_per_s": measured / seconds, "tokens_per_cpu_s": measured / cpu_s if cpu_s else None,
            "first_step": sa, "last_step": sb, "tokens": measured, "wall_s": seconds, "cpu_s": cpu_s,
            "cpu_share": cpu_s / seconds if cpu_s else None}


def analyse_group(runs: dict[str, dict[str, Any]], warmup: int, reference: dict[str, Any] | None) -> dict[str, Any]:
    """Figures of one repetition (sides that ran together): each side over its own post-warm-up window, and
    over the window common to all sides (every side past its warm-up, none finished yet). The common window
    is the like-for-like one and is used when it spans at least half of each side's own window."""
    figures: dict[str, Any] = {}
    ok = {k: r for k, r in runs.items() if not r.get("error") and len(r["steps"]) > warmup + 2}
    for name, run in runs.items():
        figures[name] = {"rc": run["rc"], "wall_s": run["wall_s"], "peak_rss_mib": run["peak_rss_mib"],
                         "time_to_first_step_s": run.get("time_to_first_step_s"), "error": run.get("error")}
    if not ok:
        return figures
    tokens = {k: step_tokens(r, reference if r is not reference else None) for k, r in ok.items()}
    lo = max(r["steps"][warmup - 1]["timestamp"] if warmup else r["t0"] for r in ok.values())
    hi = min(r["steps"][-1]["timestamp"] for r in ok.values())
    for name, run in ok.items():
        own_lo = run["steps"][warmup - 1]["timestamp"] if warmup else run["t0"]
        own = window(run, tokens[name][0], own_lo, run["steps"][-1]["timestamp"])
        common = window(run, tokens[name][0], lo, hi) if hi > lo else None
        use_common = common is not None and own is not None and common["wall_s"] >= 0.5 * own["wall_s"]
        chosen = common if use_common else own
        figures[name].update(own_window=own, common_window=common, window="common" if use_common else "own",
                             tokens_per_s=chosen and chosen["tokens_per_s"],
                             tokens_per_cpu_s=chosen and chosen["tokens_per_cpu_s"],
                             cpu_share=chosen and chosen["cpu_share"], token_source=tokens[name][1])
        if reference is not None and run is not reference:
            figures[name]["same_batches_as_hand"] = same_batches(run, reference)
            figures[name]["same_warmup_batches_as_hand"] = same_batches(
                {"steps": run["steps"][:warmup or None]}, reference)
    return figures


def rotation(items: list, rep: int) -> list:
    k = rep % len(items)
    return items[k:] + items[:k]


def compare(runner: Runner, sides: list[Side], reps: int, warmup: int,
            reference: dict[str, Any] | None = None) -> dict[str, Any]:
    """`reps` repetitions of the sides run together (start order rotating); medians per side over repetitions.

    ``reference`` is a hand-loop run of the same job (its per-step tokens and losses) for comparisons that have
    no hand side of their own."""
    groups, raw = [], []
    for rep in range(reps):
        runs = runner.run(rotation(sides, rep))
        hand = next((r for r in runs.values() if r["kind"] == "hand" and not r.get("error")), None)
        reference = reference or hand
        groups.append(analyse_group(runs, warmup, reference))
        raw.append({k: {"steps": r["steps"], "t0": r["t0"], "cpu_at_step": r["cpu_at_step"]} for k, r in runs.items()})
    summary: dict[str, Any] = {"jobs": {s.name: asdict(s.job) for s in sides}, "reps": reps,
                               "mode": "sequential" if runner.args.sequential else "concurrent",
                               "repetitions": groups, "raw": raw, "sides": {}}
    for side in sides:
        figs = [g[side.name] for g in groups]
        summary["sides"][side.name] = {
            "errors": [f["error"] for f in figs if f.get("error")],
            "mismatched_batches": sum(1 for f in figs if f.get("same_warmup_batches_as_hand") is False),
            **{f"median_{key}": median([f.get(key) for f in figs])
               for key in ("tokens_per_s", "tokens_per_cpu_s", "cpu_share", "time_to_first_step_s")},
            "median_peak_rss_mib": median([f["peak_rss_mib"] for f in figs if f["rc"] == 0]),
        }
    return summary


def pair_ratios(summary: dict[str, Any], a: str, b: str, key: str = "tokens_per_s") -> list[float | None]:
    return [ratio(g[a].get(key), g[b].get(key)) for g in summary["repetitions"]]


def padding_efficiency(lengths: list[int], batch: int, shuffles: int = 20) -> float:
    """Useful tokens / padded slots when shuffled batches of ``batch`` pad to their longest (mean of seeded
    shuffles: what padding to the longest leaves useful on this data)."""
    rng = random.Random(0)
    slots = 0
    for _ in range(shuffles):
        order = rng.sample(lengths, len(lengths))
        slots += sum(len(order[b:b + batch]) * max(order[b:b + batch]) for b in range(0, len(order), batch))
    return shuffles * sum(lengths) / slots


def epoch_throughput(run: dict[str, Any], epoch_tokens: int, epoch: int = 1) -> dict[str, Any]:
    """Useful tokens/s over one whole epoch (from the last step of the previous epoch to its own last step):
    a whole epoch holds every sample once, so its useful tokens are known exactly (``epoch_tokens``)."""
    rows = run.get("steps") or []
    if run.get("error") or not rows:
        return {"error": run.get("error") or "no steps"}
    before = [r for r in rows if r["epoch"] < epoch]
    inside = [r for r in rows if r["epoch"] == epoch]
    if not before or not inside:
        return {"error": f"no complete epoch {epoch}"}
    seconds = inside[-1]["timestamp"] - before[-1]["timestamp"]
    cpu = run.get("cpu_at_step", {})
    a, b = before[-1]["step"], inside[-1]["step"]
    cpu_s = cpu[b] - cpu[a] if a in cpu and b in cpu else None
    estimates, _ = step_tokens(run, None)  # the CLI's own count (tps x interval): does it count useful tokens?
    counted = sum(t for r, t in zip(rows, estimates, strict=False) if r["epoch"] == epoch)
    return {"tokens_per_s": epoch_tokens / seconds, "tokens_per_cpu_s": epoch_tokens / cpu_s if cpu_s else None,
            "epoch_s": seconds, "epoch_cpu_s": cpu_s, "cli_counted_over_useful": counted / epoch_tokens,
            "steps_per_epoch": [sum(1 for r in rows if r["epoch"] == e) for e in sorted({r["epoch"] for r in rows})]}
