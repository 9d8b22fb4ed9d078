"""Benchmark 5: useful tokens/s of variable-length data packed vs padded, both through the CLI."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

from data import make_variable_data
from harness import Job, Runner, Side
from report import Row, check, fmt
from stats import epoch_throughput, median, padding_efficiency, ratio, rotation

PACKING_CASES = (  # shape, samples, longest sample allowed, verdict target (None: info)
    ("long_tail", 384, 256, 1.5),
    ("narrow", 192, 128, None),
)


def section_packing(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    """5: useful (non-padding) tokens/s of the same variable-length data packed vs padded, both through the CLI
    and run side by side; the second epoch is timed (the first is the warm-up). Two length distributions: a
    long-tailed one like real SFT data (the target) and a narrow one (how little packing can gain there)."""
    return {shape: packing_case(runner, rows, quick, shape, samples, longest, target)
            for shape, samples, longest, target in PACKING_CASES}


def packing_case(runner: Runner, rows: list[Row], quick: bool, shape: str, samples: int, longest: int,
                 target: float | None) -> dict[str, Any]:
    pack_size, packed_batch, padded_batch = 256, 8, 16
    data, lengths = make_variable_data(samples, longest, shape)
    base = Job(f"packing_{shape}", data=data, max_seq_length=longest, max_steps=None, num_epochs=2, warmup=0)
    padded = replace(base, name="padded", batch_size=padded_batch)
    packed = replace(base, name="packed", batch_size=packed_batch,
                     engine_extra=["--packed_sequence.enabled", "true",
                                   "--packed_sequence.packed_sequence_size", str(pack_size)])
    useful = sum(lengths)
    efficiency = padding_efficiency(lengths, padded_batch)
    result: dict[str, Any] = {"samples": len(lengths), "mean_len": statistics.mean(lengths),
                              "median_len": statistics.median(lengths), "min_len": min(lengths),
                              "max_len": max(lengths), "epoch_tokens": useful, "padded_batch": padded_batch,
                              "padding_efficiency": efficiency, "pack_size": pack_size,
                              "packed_batch": packed_batch, "repetitions": [], "raw": []}
    sides = [Side("packed", "automodel", packed), Side("padded", "automodel", padded)]
    for rep in range(1 if quick else 2):
        runs = runner.run(rotation(sides, rep))
        result["raw"].append({k: {"steps": r["steps"], "error": r.get("error")} for k, r in runs.items()})
        result["repetitions"].append({k: epoch_throughput(r, useful) for k, r in runs.items()})
        if runs["packed"].get("error"):
            break
    first = result["repetitions"][0]
    unavailable = None
    if first["packed"].get("error"):
        unavailable = "the packed run failed: " + first["packed"]["error"][-300:]
    elif not first["padded"].get("error") and first["packed"]["steps_per_epoch"] == first["padded"]["steps_per_epoch"]:
        unavailable = "packed_sequence is accepted but not applied (same steps per epoch as padding)"
    if unavailable:
        rows.append(Row("5", f"packing ({shape}): useful tokens/s", "not available", "", None, "", "skip",
                        unavailable))
        result.update(available=False, reason=unavailable)
        return result
    result["available"] = True
    fill = useful / (math.ceil(useful / pack_size) * pack_size)
    out = {}
    for key, unit in (("tokens_per_s", "useful tokens/s"), ("tokens_per_cpu_s", "useful tokens/CPU-s")):
        pk = median([g["packed"].get(key) for g in result["repetitions"]])
        pd = median([g["padded"].get(key) for g in result["repetitions"]])
        out[key] = ratio(pk, pd)
        counted = median([g["packed"].get("cli_counted_over_useful") for g in result["repetitions"]])
        steps = first["packed"]["steps_per_epoch"][0], first["padded"]["steps_per_epoch"][0]
        note = (f"{len(lengths)} samples of {min(lengths)}-{max(lengths)} tokens (mean "
                f"{statistics.mean(lengths):.0f}, median {statistics.median(lengths):.0f}); padded: batch "
                f"{padded_batch} to the longest, {steps[1]} steps/epoch, {efficiency:.0%} of its slots useful; "
                f"packed: {packed_batch} rows x {pack_size}, {steps[0]} steps/epoch (at best {fill:.0%} full); "
                f"epoch 2 timed; the CLI's own tps counts {counted:.3f}x the useful tokens when packed"
                if key == "tokens_per_s" and counted else "")
        verdict, shown = ("info", "") if target is None else (check(out[key], ">=", target), f">= {target}")
        rows.append(Row("5", f"{unit}, packed vs padded ({shape.replace('_', '-')})", fmt(pk) + " packed",
                        fmt(pd) + " padded", out[key], shown, verdict, note))
    result["ratio"] = out
    runner.note(f"packing {shape}: {out}")
    return result
