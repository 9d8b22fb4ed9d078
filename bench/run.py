#!/usr/bin/env python
"""automodel performance benchmarks (``make bench`` runs ``.venv/bin/python bench/run.py``).

Every comparison runs both sides in this one invocation, alternating them (rotating the order each
repetition), and reports medians; every raw figure lands in ``bench/results.json``. The real CLI
(``automodel finetune llm``) runs as a subprocess and its throughput is read from what it writes
(``training.jsonl``, ``log_interval: 1``): warm-up steps are excluded and tokens are non-padding input tokens on
every side. See docs/performance.md for what each number means.

  .venv/bin/python bench/run.py            # full run (~6-8 min on 2 busy cores)
  .venv/bin/python bench/run.py --quick    # ~1-2 min: fewer repetitions, no scaling sweep
  .venv/bin/python bench/run.py --only training,cli_start
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata, util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PY = sys.executable
AUTOMODEL = str(Path(PY).parent / "automodel")
LLM_PKG = Path(util.find_spec("automodel_llm").submodule_search_locations[0])  # found, not imported
ASSETS = LLM_PKG / "examples" / "assets"
WORK = Path(tempfile.gettempdir()) / f"automodel-bench-{os.getuid()}"  # persistent: datasets caches stay warm
# Every run reads a snapshot of the shipped assets taken at start (snapshot_assets), so that all sides of a
# comparison see the same files even while the package's assets are being regenerated.
SNAPSHOT = WORK / "assets"
TINY_CONFIG = SNAPSHOT / "tiny_llama" / "config.json"
TOKENIZER = SNAPSHOT / "tiny_tokenizer"
TINY_SQUAD = SNAPSHOT / "tiny_squad"
CONFIGS = SNAPSHOT / "configs"  # bench/configs/*.json with the tiny tokenizer's vocabulary filled in
TEMPLATES = BENCH / "configs"
BATCH = 32  # the tiny default's dataloader.batch_size

ASSET_INFO: dict[str, Any] = {}
SECTIONS = ["training", "loop_overhead", "training_20m", "cli_start", "config_refusal", "checkpoint_io", "packing",
            "scaling"]


# ---- processes -----------------------------------------------------------------------------------------------

@dataclass
class Proc:
    cmd: list[str]
    t0: float  # time.time() just before the process was started
    wall: float
    rc: int
    maxrss_mib: float
    log: str  # path of its combined stdout/stderr
    cpu_samples: list = field(default_factory=list)  # (lines in the watched file, time.time(), child CPU s)
    cpu_total: float | None = None

    def tail(self, n: int = 15) -> str:
        try:
            lines = Path(self.log).read_text(encoding="utf-8", errors="replace").replace("\r", "\n").splitlines()
        except OSError:
            return ""
        return "\n".join(line for line in lines[-n:] if line.strip())


def child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
               TOKENIZERS_PARALLELISM="false")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def cpu_seconds(pid: int) -> float | None:
    """On-CPU time of the process's live threads (ns resolution, /proc/<pid>/task/*/schedstat)."""
    total = 0
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                with open(f"{task.path}/schedstat", "rb") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        return None
    return total / 1e9


def run_proc(cmd: list[str], log: Path, env: dict[str, str], cwd: Path = WORK, timeout: float = 300) -> Proc:
    """Run to completion; wall time and peak RSS of exactly this child (wait4), not of the bench."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        t0 = time.time()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - start
    rc = os.waitstatus_to_exitcode(status)
    proc.returncode = rc  # reaped by wait4 above
    return Proc([str(c) for c in cmd], t0, wall, rc, usage.ru_maxrss / 1024, str(log),
                cpu_total=usage.ru_utime + usage.ru_stime)


def run_together(specs: list[tuple[list[str], Path, Path]], env: dict[str, str], timeout: float = 300,
                 cwd: Path = WORK) -> list[Proc]:
    """Start several (cmd, log, watched JSONL) at once and wait for all of them.

    Each child's CPU time is sampled whenever its JSONL (one line per optimizer step) grows; the files are
    polled every 2 ms, so a step window's CPU seconds can be told apart from the wall seconds that other
    processes on a shared machine stretch.
    """
    children = []
    for cmd, log, watch in specs:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "wb")  # noqa: SIM115 - closed below
        t0, start = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd)
        children.append({"cmd": cmd, "log": log, "watch": watch, "out": out, "proc": proc, "t0": t0,
                         "start": start, "size": 0, "samples": [], "done": None})
    deadline = time.perf_counter() + timeout
    while any(c["done"] is None for c in children):
        for c in children:
            if c["done"] is not None:
                continue
            pid, status, usage = os.wait4(c["proc"].pid, os.WNOHANG)
            if pid:
                c["done"] = (status, usage, time.perf_counter() - c["start"])
                continue
            try:
                size = os.stat(c["watch"]).st_size
            except OSError:
                size = c["size"]
            if size != c["size"]:
                cpu = cpu_seconds(c["proc"].pid)
                with open(c["watch"], "rb") as f:
                    lines = f.read().count(b"\n")
                c["size"] = size
                c["samples"].append((lines, time.time(), cpu))
        if time.perf_counter() > deadline:
            for c in children:
                if c["done"] is None:
                    c["proc"].kill()
        time.sleep(0.002)
    results = []
    for c in children:
        c["out"].close()
        status, usage, wall = c["done"]
        rc = os.waitstatus_to_exitcode(status)
        c["proc"].returncode = rc
        results.append(Proc([str(x) for x in c["cmd"]], c["t0"], wall, rc, usage.ru_maxrss / 1024, str(c["log"]),
                            c["samples"], usage.ru_utime + usage.ru_stime))
    return results


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- the training job, as the CLI and the baselines each spell it ------------------------------------------

@dataclass
class Job:
    name: str
    model_config: Path = TINY_CONFIG
    data: Path = TINY_SQUAD
    max_seq_length: int = 64
    truncation: bool = False
    batch_size: int = BATCH
    max_steps: int | None = 75
    num_epochs: int = 100
    warmup: int = 25  # steps excluded from tokens/s
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)  # set on every side (the example config's own are these too)
    warmup_steps: int = 20
    min_lr: float = 1e-4
    max_norm: float = 1.0
    seed: int = 1234
    engine_extra: list[str] = field(default_factory=list)

    def engine_cmd(self, run_dir: Path) -> list[str]:
        def b(value: bool) -> str:
            return "true" if value else "false"

        return [AUTOMODEL, "finetune", "llm", "-c", "llm/tiny_squad",
                "--checkpoint.checkpoint_dir", str(run_dir), "--checkpoint.enabled", "false",
                "--eval_generation.enabled", "false",
                "--step_scheduler.max_steps", "null" if self.max_steps is None else str(self.max_steps),
                "--step_scheduler.num_epochs", str(self.num_epochs),
                "--step_scheduler.log_interval", "1", "--step_scheduler.val_check_interval", "null",
                "--step_scheduler.grad_accumulation_steps", "1",
                "--model.config", str(self.model_config),
                "--tokenizer.pretrained_model_name_or_path", str(TOKENIZER),
                "--dataset.dataset_name", str(self.data), "--dataset.max_seq_length", str(self.max_seq_length),
                "--dataset.truncation", b(self.truncation),
                "--validation_dataset.dataset_name", str(TINY_SQUAD),
                "--dataloader.batch_size", str(self.batch_size),
                "--optimizer.lr", repr(self.lr), "--optimizer.weight_decay", repr(self.weight_decay),
                "--optimizer.betas", f"[{self.betas[0]!r}, {self.betas[1]!r}]",
                "--lr_scheduler.warmup_steps", str(self.warmup_steps), "--lr_scheduler.min_lr", repr(self.min_lr),
                "--clip_grad_norm.max_norm", repr(self.max_norm), "--rng.seed", str(self.seed),
                *self.engine_extra]

    def baseline_cmd(self, script: str, out: Path) -> list[str]:
        assert self.max_steps is not None, "baselines run a fixed number of steps"
        cmd = [PY, str(BENCH / "baselines" / script), "--model-config", str(self.model_config),
               "--tokenizer", str(TOKENIZER), "--data", str(self.data), "--val-data", str(TINY_SQUAD),
               "--max-seq-length", str(self.max_seq_length), "--batch-size", str(self.batch_size),
               "--max-steps", str(self.max_steps), "--lr", repr(self.lr), "--weight-decay", repr(self.weight_decay),
               "--betas", repr(self.betas[0]), repr(self.betas[1]),
               "--warmup-steps", str(self.warmup_steps), "--min-lr", repr(self.min_lr),
               "--max-norm", repr(self.max_norm), "--seed", str(self.seed), "--out", str(out)]
        return cmd + (["--truncation"] if self.truncation else [])


@dataclass
class Side:
    """One side of a comparison: who runs (automodel CLI / hand loop / HF Trainer) which job."""
    name: str  # how results are keyed
    kind: str  # automodel | hand | trainer
    job: Job


class Runner:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.env = child_env(args.threads)
        self.counter = 0
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def note(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", file=sys.stderr, flush=True)

    def run(self, sides: list[Side]) -> dict[str, dict[str, Any]]:
        """Run the sides *at the same time* (concurrent mode, the default) or one after the other (--sequential).

        Side by side at the same moment, every side meets the same competition from whatever else the machine
        runs; one after another, a busy minute lands on one side only (on the shared 2-core machine this bench
        was written on that swung single runs by 2x)."""
        specs = []
        for side in sides:
            self.counter += 1
            run_dir = WORK / "runs" / f"{self.counter:03d}-{side.job.name}-{side.name}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            if side.kind == "automodel":
                cmd, out = side.job.engine_cmd(run_dir), run_dir / "training.jsonl"
            else:
                out = run_dir / "steps.jsonl"
                cmd = side.job.baseline_cmd({"hand": "hand_loop.py", "trainer": "hf_trainer.py"}[side.kind], out)
            specs.append((side, run_dir, cmd, out))
        if self.args.sequential:
            procs = [run_together([(cmd, d / "output.log", out)], self.env, self.args.run_timeout)[0]
                     for _, d, cmd, out in specs]
        else:
            procs = run_together([(cmd, d / "output.log", out) for _, d, cmd, out in specs], self.env,
                                 self.args.run_timeout)
        results = {}
        for (side, run_dir, _, out), proc in zip(specs, procs, strict=False):
            rows = read_jsonl(out)
            cpu_at: dict[int, float] = {}  # step -> child CPU s when the bench first saw that step's line
            for lines, _, cpu in proc.cpu_samples:
                if cpu is not None and 0 < lines <= len(rows):
                    cpu_at.setdefault(rows[lines - 1]["step"], cpu)
            result: dict[str, Any] = {"side": side.name, "kind": side.kind, "job": side.job.name, "rc": proc.rc,
                                      "wall_s": proc.wall, "peak_rss_mib": proc.maxrss_mib, "t0": proc.t0,
                                      "cmd": proc.cmd, "steps": rows, "cpu_at_step": cpu_at,
                                      "cpu_total_s": proc.cpu_total}
            if proc.rc != 0 or not rows:
                result["error"] = f"exit {proc.rc}: " + proc.tail()
            else:
                result["time_to_first_step_s"] = rows[0]["timestamp"] - proc.t0
            self.note(f"{side.job.name:<14} {side.name:<9} rc={proc.rc} wall={proc.wall:5.1f}s "
                      f"rss={proc.maxrss_mib:5.0f}MiB steps={len(rows)}")
            if not self.args.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
            results[side.name] = result
        return results


# ---- throughput from per-step records -----------------------------------------------------------------------

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


# ---- the table -------------------------------------------------------------------------------------------------

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


# ---- sections ----------------------------------------------------------------------------------------------------

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
    _flag_batches(rows, summary)
    r2 = throughput_rows(rows, "2", "vs HF Trainer (tiny)", vs_trainer, "trainer", 1.15)
    _flag_batches(rows, vs_trainer)
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


def _flag_batches(rows: list[Row], summary: dict[str, Any]) -> None:
    for side, data in summary["sides"].items():
        if data["errors"]:
            rows[-1].note += f" {side} errors: {data['errors'][0][:300]}"
        if data["mismatched_batches"]:
            rows[-1].note += (f" {side}: warm-up losses differ from the hand loop's (not the same model, data or "
                              "optimizer: the comparison is not like for like).")


JOB_20M = Job("llama_20m", model_config=CONFIGS / "llama_20m.json", batch_size=8, max_steps=10, warmup=2)


def section_training_20m(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    job = replace(JOB_20M, max_steps=7, warmup=2) if quick else JOB_20M
    summary = compare(runner, [Side(k, k, job) for k in ("automodel", "hand")], 1 if quick else 3, job.warmup)
    summary["ratios"] = throughput_rows(rows, "1", f"Llama {millions('llama_20m')} (batch 8)", summary, "hand", 0.97)
    _flag_batches(rows, summary)
    return summary


def section_loop_overhead(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    """1, in one process: the engine's real loop and the hand loop interleaved step by step (bench/interleave.py),
    at the tiny default's log_interval (10). Whatever else the machine runs hits both sides within milliseconds,
    so this resolves differences of ~1% that separate processes cannot on a busy machine."""
    steps = 60 if quick else 90
    result: dict[str, Any] = {"runs": []}
    for rep in range(1 if quick else 2):
        run_dir = WORK / "runs" / f"interleave-{rep}"
        shutil.rmtree(run_dir, ignore_errors=True)
        log = WORK / "interleave.log"
        # logits at every position, as the hand loop computes them: the same work on both sides, so what
        # differs is the loop itself (the default, label positions only, is measured against the hand loop in 1)
        proc = run_proc([PY, str(BENCH / "interleave.py"), "--model-config", str(TINY_CONFIG), "--tokenizer",
                         str(TOKENIZER), "--data", str(TINY_SQUAD), "--steps", str(steps), "--run-dir", str(run_dir),
                         "--", "--logits.label_positions_only", "false"],
                        log, runner.env, timeout=runner.args.run_timeout)
        found = [line for line in Path(log).read_text(encoding="utf-8", errors="replace").splitlines()
                 if line.startswith("{")]
        shutil.rmtree(run_dir, ignore_errors=True)
        if proc.rc != 0 or not found:
            rows.append(Row("1", "in-process loop overhead", "error", "", None, "", "n/a", proc.tail()[:300]))
            result["error"] = proc.tail()
            return result
        result["runs"].append(json.loads(found[-1]))
    runs = result["runs"]
    for key, unit in (("cpu", "CPU"), ("wall", "wall")):
        r = median([x[f"throughput_ratio_{key}"] for x in runs])
        per = median([x[f"engine_minus_hand_ms_per_step_{key}"] for x in runs])
        same = all(x["same_losses"] for x in runs)
        rows.append(Row("1", f"loop overhead, one process, interleaved ({unit})", f"{per:+.2f} ms/step vs hand",
                        "hand loop", r, ">= 0.97", check(r, ">=", 0.97),
                        f"{len(runs)} x {runs[0]['timed_steps']} timed step pairs, both computing logits at every "
                        "position (--logits.label_positions_only false); per-run ratios "
                        + ", ".join(f"{x[f'throughput_ratio_{key}']:.3f}" for x in runs)
                        + ("; same losses as the hand loop" if same else "; LOSSES DIFFER from the hand loop")))
        result[f"ratio_{key}"] = r
    for x in runs:
        x.pop("records", None) if len(json.dumps(x)) > 200_000 else None
    return result


def heavy_imports(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """-X importtime: which heavy top-level packages a command imports, and the total import time."""
    proc = run_proc([PY, "-X", "importtime", *cmd], log, env, timeout=120)
    text = Path(log).read_text(encoding="utf-8", errors="replace")
    top: dict[str, float] = {}
    for m in re.finditer(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$", text, re.M):
        name = m.group(4)
        top.setdefault(name.split(".")[0], 0.0)
        if len(m.group(3)) == 1:  # direct imports of __main__: cumulative times add up
            top[name.split(".")[0]] += int(m.group(2)) / 1e6
    heavy = [p for p in ("torch", "transformers", "datasets", "numpy", "safetensors", "pyarrow", "pandas")
             if p in top]
    return {"rc": proc.rc, "imports": heavy, "imports_torch": "torch" in top,
            "import_s": round(sum(top.values()), 3), "slowest": sorted(top.items(), key=lambda kv: -kv[1])[:6]}


def section_cli_start(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    commands = {"python -c pass": [PY, "-c", "pass"], "automodel --help": [AUTOMODEL, "--help"],
                "automodel recipes": [AUTOMODEL, "recipes"], "automodel plugins": [AUTOMODEL, "plugins"]}
    reps = 3 if quick else 7
    times: dict[str, list[float]] = {k: [] for k in commands}
    rcs: dict[str, list[int]] = {k: [] for k in commands}
    names = list(commands)
    for rep in range(reps + 1):  # the first round warms the page cache and is dropped
        for name in rotation(names, rep):
            proc = run_proc(commands[name], WORK / "cli.log", runner.env, timeout=60)
            if rep:
                times[name].append(proc.wall)
                rcs[name].append(proc.rc)
    imports = {name: heavy_imports(cmd[1:] if cmd[0] == PY else cmd, runner.env, WORK / "importtime.log")
               for name, cmd in commands.items() if name != "python -c pass"}
    base = median(times["python -c pass"])
    runner.note("cli start: " + ", ".join(f"{k} {median(v):.3f}s" for k, v in times.items()))
    for name in names[1:]:
        t = median(times[name])
        torch_note = "imports torch!" if imports[name]["imports_torch"] else "no torch"
        target, verdict = ("<= 0.25 s", check(t, "<=", 0.25)) if name == "automodel --help" else ("", "info")
        if imports[name]["imports_torch"]:
            verdict = "FAIL"
        bad_rc = [rc for rc in rcs[name] if rc != 0]
        rows.append(Row("3", f"{name} wall", fmt(t, " s", 3), fmt(base, " s", 3) + " python -c pass",
                        ratio(t, base), target, verdict,
                        f"{torch_note}; heavy imports: {', '.join(imports[name]['imports']) or 'none'}"
                        + (f"; exit codes {bad_rc}" if bad_rc else "")))
    return {"reps": reps, "wall_s": times, "rc": rcs, "median_s": {k: median(v) for k, v in times.items()},
            "imports": imports}


def bad_config() -> Path:
    """The tiny default with two mistakes (a misspelled key and a wrong optimizer argument)."""
    text = (LLM_PKG / "examples" / "tiny_squad.yaml").read_text(encoding="utf-8")
    mistakes = 0
    for good, bad in (("  max_steps:", "  max_stepz:"), ("  lr:", "  lrr:")):
        if good in text:
            text = text.replace(good, bad, 1)
            mistakes += 1
    if not mistakes:
        text += "\noptimizerr:\n  lr: 1.0\n"
    path = WORK / "bad.yaml"
    path.write_text(text.replace("${pkg:automodel_llm}", str(LLM_PKG)), encoding="utf-8")
    return path


def section_config_refusal(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    path = bad_config()
    commands = {"automodel validate": [AUTOMODEL, "validate", "-c", str(path)],
                "automodel finetune llm": [AUTOMODEL, "finetune", "llm", "-c", str(path),
                                           "--checkpoint.checkpoint_dir", str(WORK / "refused")]}
    reps = 1 if quick else 3
    times: dict[str, list[float]] = {k: [] for k in commands}
    rcs: dict[str, list[int]] = {k: [] for k in commands}
    for rep in range(reps):
        for name in rotation(list(commands), rep):
            proc = run_proc(commands[name], WORK / "refusal.log", runner.env, timeout=120)
            times[name].append(proc.wall)
            rcs[name].append(proc.rc)
    imports = heavy_imports(commands["automodel validate"], runner.env, WORK / "importtime.log")
    output = Path(WORK / "refusal.log").read_text(encoding="utf-8", errors="replace")
    for name in commands:
        t = median(times[name])
        exit_ok = all(rc == 2 for rc in rcs[name])
        verdict = check(t, "<=", 3.0) if exit_ok else "FAIL"
        rows.append(Row("8", f"refuse bad config: {name}", fmt(t, " s", 2), "", None, "<= 3 s, exit 2", verdict,
                        f"exit codes {sorted(set(rcs[name]))}" + ("" if exit_ok else " (expected 2)")
                        + (f"; validate imports {', '.join(imports['imports'])} ({imports['import_s']:.2f} s of "
                           "imports)" if name == "automodel validate" else "")))
    runner.note("refusal: " + ", ".join(f"{k} {median(v):.2f}s rc={rcs[k]}" for k, v in times.items()))
    return {"reps": reps, "config": path.read_text(encoding="utf-8"), "wall_s": times, "rc": rcs,
            "validate_imports": imports, "last_output": output[-2000:]}


def section_checkpoint_io(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    reps = 3 if quick else 9
    log = WORK / "ckpt_io.log"
    proc = run_proc([PY, str(BENCH / "ckpt_io.py"), "--model-config", str(CONFIGS / "llama_20m.json"),
                     "--reps", str(reps), "--dir", str(WORK / "ckpt")], log, runner.env, timeout=300)
    text = Path(log).read_text(encoding="utf-8", errors="replace")
    found = [line for line in text.splitlines() if line.startswith("{")]
    if proc.rc != 0 or not found:
        rows.append(Row("4", "checkpoint save/load", "error", "", None, "<= 1.25", "n/a", proc.tail()[:300]))
        return {"error": proc.tail(), "rc": proc.rc}
    data = json.loads(found[-1])
    med = data["median_s"]
    size = f"{data['num_params'] / 1e6:.1f}M params, {data['bytes'] / 2**20:.0f} MiB"
    for op in ("save", "load"):
        r = ratio(med[f"engine_{op}"], med[f"raw_{op}"])
        times = data["times_s"]
        pairs = [ratio(a, b) for a, b in zip(times[f"engine_{op}"], times[f"raw_{op}"], strict=False)]
        note = f"{size}; median of per-repetition ratios {median(pairs):.2f}"
        if op == "load":
            note += (f"; round trip equal: {data['round_trip_equal']}; raw = load_file + load_state_dict "
                     f"(load_file alone maps lazily: {med['raw_load_file_only'] * 1e3:.1f} ms)")
        else:
            note += (f"; engine writes {', '.join(data['engine_files'])} + trainer_state/config, fsync, rename; "
                     f"raw's time includes unlinking its previous file, the engine deletes the retired "
                     f"checkpoint in the background (then {med['engine_retention'] * 1e3:.1f} ms, awaited untimed)")
        rows.append(Row("4", f"checkpoint {op} (Llama {millions('llama_20m')})", fmt(med[f"engine_{op}"], " s", 3),
                        fmt(med[f"raw_{op}"], " s", 3) + " safetensors", r, "<= 1.25", check(r, "<=", 1.25), note))
        data[f"ratio_{op}"] = r
        data[f"pair_ratios_{op}"] = pairs
    runner.note(f"checkpoint io: save {data['ratio_save']:.2f}x load {data['ratio_load']:.2f}x")
    return data


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


# ---- main ----------------------------------------------------------------------------------------------------------

def snapshot_assets() -> dict[str, Any]:
    """Copy the shipped tiny assets (only files that changed: the datasets cache stays valid) and write the
    bench's bigger Llama configs with the tiny tokenizer's vocabulary and special-token ids."""
    for name in ("tiny_llama", "tiny_tokenizer", "tiny_squad"):
        src, dst = ASSETS / name, SNAPSHOT / name
        dst.mkdir(parents=True, exist_ok=True)
        for file in src.iterdir():
            if file.is_file():
                target = dst / file.name
                if not target.is_file() or target.read_bytes() != file.read_bytes():
                    shutil.copy2(file, target)
    tiny = json.loads(TINY_CONFIG.read_text(encoding="utf-8"))
    CONFIGS.mkdir(parents=True, exist_ok=True)
    params = {}
    for template in sorted(TEMPLATES.glob("*.json")):
        config = json.loads(template.read_text(encoding="utf-8"))
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
            config[key] = tiny[key]
        text = json.dumps(config, indent=2) + "\n"
        target = CONFIGS / template.name
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
        params[template.stem] = llama_params(config)
    samples = sum(1 for line in (TINY_SQUAD / "train.jsonl").read_text(encoding="utf-8").splitlines() if line.strip())
    return {"tiny_squad_train_samples": samples, "tiny_epoch_steps": -(-samples // BATCH),
            "params": {"tiny_llama": llama_params(tiny), **params}, "vocab_size": tiny["vocab_size"]}


def millions(name: str) -> str:
    return f"{ASSET_INFO['params'][name] / 1e6:.1f}M"


def llama_params(c: dict[str, Any]) -> int:
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * c.get("head_dim", h // c["num_attention_heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return n * layer + v * h * (1 if c.get("tie_word_embeddings") else 2) + h


def machine_info(threads: int | None) -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"cpu": cpu, "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "threads_per_run": threads, "load_average_start": os.getloadavg(), "platform": platform.platform(),
            "python": platform.python_version(),
            "versions": {d: version(d) for d in ("torch", "transformers", "accelerate", "datasets", "torchdata",
                                                 "safetensors", "tokenizers", "automodel-core", "automodel-llm")},
            "env": {k: os.environ.get(k) for k in ("PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS")}}


# seconds each section needs on this 2-core machine, full / quick (a section is skipped past the budget)
COST = {"training": (120, 35), "loop_overhead": (45, 20), "training_20m": (70, 25), "cli_start": (20, 8),
        "config_refusal": (20, 8), "checkpoint_io": (30, 15), "packing": (80, 45), "scaling": (110, 60)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no sequence-length sweep")
    parser.add_argument("--only", default=None, help=f"comma-separated sections: {', '.join(SECTIONS)}")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (OMP_NUM_THREADS; default 1: on a shared 2-core machine a "
                             "2-thread run waits on whichever core is busy; 0 = torch's default)")
    parser.add_argument("--sequential", action="store_true",
                        help="run the sides of a comparison one after another instead of at the same time")
    parser.add_argument("--budget", type=float, default=780, help="seconds; sections that would end later are skipped")
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds per training run")
    parser.add_argument("--out", default=str(BENCH / "results.json"))
    parser.add_argument("--keep", action="store_true", help=f"keep run directories under {WORK}/runs")
    args = parser.parse_args()
    args.threads = args.threads or None
    chosen = SECTIONS if not args.only else [s.strip() for s in args.only.split(",")]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    WORK.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK / "runs", ignore_errors=True)
    ASSET_INFO.update(snapshot_assets())

    runner = Runner(args)
    results: dict[str, Any] = {"machine": machine_info(args.threads), "mode": "quick" if args.quick else "full",
                               "assets": dict(ASSET_INFO),
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}
    rows: list[Row] = []
    functions: dict[str, Callable[..., dict[str, Any]]] = {
        "training": section_training, "loop_overhead": section_loop_overhead,
        "training_20m": section_training_20m, "cli_start": section_cli_start,
        "config_refusal": section_config_refusal, "checkpoint_io": section_checkpoint_io,
        "packing": section_packing}
    for name in SECTIONS:
        if name not in chosen:
            continue
        if args.quick and name == "scaling":
            rows.append(Row("6", "scaling", "skipped in --quick", "", None, "", "skip"))
            continue
        cost = COST[name][1 if args.quick else 0]
        if runner.elapsed() + cost > args.budget:
            rows.append(Row("-", name, "skipped: time budget", "", None, "", "skip",
                            f"{runner.elapsed():.0f}s used, ~{cost}s needed, budget {args.budget:.0f}s"))
            continue
        runner.note(f"== {name}")
        start = time.perf_counter()
        try:
            if name == "scaling":
                data = section_scaling(runner, rows, args.quick, results["sections"])
            else:
                data = functions[name](runner, rows, args.quick)
        except Exception as err:  # a broken section must not lose the others' figures
            import traceback

            data = {"error": traceback.format_exc()}
            rows.append(Row("-", name, "error", "", None, "", "n/a", f"{type(err).__name__}: {err}"))
        data["section_s"] = time.perf_counter() - start
        results["sections"][name] = data
    results["runtime_s"] = runner.elapsed()
    results["machine"]["load_average_end"] = os.getloadavg()
    results["table"] = [asdict(r) for r in rows]
    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    load = results["machine"]["load_average_start"]
    versions = results["machine"]["versions"]
    print(f"\nautomodel bench ({results['mode']}): {results['machine']['cpu']}, {results['machine']['cores']} cores, "
          f"{args.threads or 'default'} thread(s) per run, load average at start {load[0]:.1f}; "
          f"torch {versions['torch']}, transformers {versions['transformers']}\n")
    print_table(rows)
    print(f"\nruntime {results['runtime_s']:.0f} s; raw figures in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
