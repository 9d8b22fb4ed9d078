"""Benchmarks 1, 2 and 7: the tiny default and a 20M Llama through the CLI vs the hand loop vs HF Trainer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from harness import ASSET_INFO, CONFIGS, Job, Runner, Side, millions
from report import Row, check, flag_batches, fmt, throughput_rows
from stats import compare, ratio

JOB_20M = Job("llama_20m", model_config=CONFIGS / "llama_20m.json", batch_size=8, max_steps=10, warmup=2)


def section_training(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    """1 (tiny), 2 and 7: the tiny default through the CLI vs the hand loop vs HF Trainer."""
    epoch = ASSET_INFO["tiny_epoch_steps"]  # the first epoch is the warm-up; one (quick) or two more are timed
    job = Job("tiny_squad", max_steps=epoch * (2 if quick else 3), warmup=epoch)
    # untimed warm-up: builds the datasets cache of tiny_squad and warms the page cache for all three sides
    warm = runner.run([Side("automodel", "automodel", replace(job, name="warmup", max_steps=1, warmup=0))])
    # In pairs, so that on a 2-core machine each process has a core of its own: with three processes on two
    # cores, wall tokens/s measures how the kernel shares the cores out, not the frameworks.
    reps = 1 if quick else 3
    summary = compare(runner, [Side(k, k, job) for k in ("automodel", "hand")], reps, job.warmup)
    vs_trainer = compare(runner, [Side(k, k, job) for k in ("automodel", "trainer")], reps, job.warmup,
                         reference=summary["raw"][0]["hand"])
    summary["warmup_run"] = {k: warm["automodel"].get(k) for k in ("rc", "wall_s", "error")}
    summary["vs_trainer"] = vs_trainer
    sides = summary["sides"]
    r1 = throughput_rows(rows, "1", f"tiny default ({millions('tiny_llama')})", summary, "hand", 0.97)
    flag_batches(rows, summary)
    r2 = throughput_rows(rows, "2", "vs HF Trainer (tiny)", vs_trainer, "trainer", 1.15)
    flag_batches(rows, vs_trainer)
    t_am, t_hand = sides["automodel"]["median_time_to_first_step_s"], sides["hand"]["median_time_to_first_step_s"]
    r7 = ratio(t_am, t_hand)
    rows.append(Row("7", "time to first step (tiny)", fmt(t_am, " s", 2), fmt(t_hand, " s", 2) + " hand", r7,
                    "<= 1.5", check(r7, "<=", 1.5),
                    f"Trainer: {fmt(vs_trainer['sides']['trainer']['median_time_to_first_step_s'], ' s', 2)}"))
    m_am, m_hand = sides["automodel"]["median_peak_rss_mib"], sides["hand"]["median_peak_rss_mib"]
    r7m = ratio(m_am, m_hand)
    rows.append(Row("7", "peak RSS (tiny)", fmt(m_am, " MiB"), fmt(m_hand, " MiB") + " hand", r7m, "<= 1.2",
                    check(r7m, "<=", 1.2),
                    f"Trainer: {fmt(vs_trainer['sides']['trainer']['median_peak_rss_mib'], ' MiB')}"))
    summary["ratios"] = {"automodel_over_hand": r1, "automodel_over_trainer": r2, "ttfs": r7, "peak_rss": r7m}
    return summary


def section_training_20m(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    job = replace(JOB_20M, max_steps=7, warmup=2) if quick else JOB_20M
    summary = compare(runner, [Side(k, k, job) for k in ("automodel", "hand")], 1 if quick else 3, job.warmup)
    summary["ratios"] = throughput_rows(rows, "1", f"Llama {millions('llama_20m')} (batch 8)", summary, "hand", 0.97)
    flag_batches(rows, summary)
    return summary
