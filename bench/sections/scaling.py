"""Benchmark 6: throughput against model size and sequence length, automodel and the hand loop side by side."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from data import make_long_data
from harness import ASSET_INFO, CONFIGS, TINY_CONFIG, Job, Runner, Side, millions
from report import Row, fmt
from stats import compare, ratio

from sections.training import JOB_20M


def section_scaling(runner: Runner, rows: list[Row], quick: bool, done: dict[str, Any]) -> dict[str, Any]:
    """6: throughput against model size (3 sizes, tiny_squad at batch 8) and sequence length (3 lengths at
    ~2048 tokens a step, the 5M model), automodel and the hand loop side by side, one repetition per point.
    Shown per CPU second (single repetitions of wall time on a busy machine are noise); wall figures in notes."""
    result: dict[str, Any] = {"model_size": [], "seq_length": []}

    def point(kind: str, label: str, summary: dict[str, Any], extra: dict[str, Any]) -> None:
        sides = summary["sides"]
        fig = {key: {s: sides[s][f"median_{key}"] for s in ("automodel", "hand")}
               for key in ("tokens_per_s", "tokens_per_cpu_s")}
        r_cpu = ratio(fig["tokens_per_cpu_s"]["automodel"], fig["tokens_per_cpu_s"]["hand"])
        r_wall = ratio(fig["tokens_per_s"]["automodel"], fig["tokens_per_s"]["hand"])
        result[kind].append({"label": label, **extra, **fig, "ratio_cpu": r_cpu, "ratio_wall": r_wall,
                             "reps": summary["reps"], "repetitions": summary["repetitions"]})
        rows.append(Row("6", label + " (per CPU-s)", fmt(fig["tokens_per_cpu_s"]["automodel"]),
                        fmt(fig["tokens_per_cpu_s"]["hand"]) + " hand", r_cpu, "", "info",
                        f"n={summary['reps']}; wall tokens/s {fmt(fig['tokens_per_s']['automodel'])} vs "
                        f"{fmt(fig['tokens_per_s']['hand'])} (ratio {fmt(r_wall, '', 3)})"))

    for name in ("tiny_llama", "llama_5m", "llama_20m"):
        config = TINY_CONFIG if name == "tiny_llama" else CONFIGS / f"{name}.json"
        job = replace(JOB_20M, name=f"size-{name}", model_config=config)
        if name == "llama_20m" and done.get("training_20m", {}).get("sides"):
            summary = done["training_20m"]  # the same job, already measured
        else:
            summary = compare(runner, [Side(k, k, job) for k in ("automodel", "hand")], 1, job.warmup)
        point("model_size", f"size {millions(name)}, seq<=64 x batch 8", summary,
              {"params": ASSET_INFO["params"][name]})
    for length in (128, 512, 1024):
        batch = max(1, 2048 // length)
        data = make_long_data(length, max(24, batch * 8))
        job = Job(f"seq-{length}", model_config=CONFIGS / "llama_5m.json", data=data, max_seq_length=length,
                  truncation=True, batch_size=batch, max_steps=6, warmup=2)
        summary = compare(runner, [Side(k, k, job) for k in ("automodel", "hand")], 1, job.warmup)
        point("seq_length", f"seq {length} x batch {batch}, {millions('llama_5m')}", summary,
              {"seq_length": length, "batch": batch})
    return result
