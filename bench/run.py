#!/usr/bin/env python
"""automodel performance benchmarks (``make bench`` runs ``.venv/bin/python bench/run.py``).

Every comparison runs both sides in this one invocation, alternating them (rotating the order each
repetition), and reports medians; every raw figure lands in ``bench/results.json``. The real CLI
(``automodel finetune llm``) runs as a subprocess and its throughput is read from what it writes
(``training.jsonl``, ``log_interval: 1``): warm-up steps are excluded and tokens are non-padding input tokens on
every side. See docs/performance.md for what each number means. The harness (harness.py), statistics (stats.py),
table (report.py), generated data (data.py) and one module per section (sections/) live beside this file.

  .venv/bin/python bench/run.py            # full run (~15-20 min on 2 busy cores, sections 9-11 included)
  .venv/bin/python bench/run.py --quick    # ~1-2 min: fewer repetitions, no scaling sweep
  .venv/bin/python bench/run.py --only training,cli_start
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness import ASSET_INFO, BENCH, WORK, Runner, machine_info, snapshot_assets
from report import Row, print_table
from sections import SECTIONS

# seconds each section needs on this 2-core machine, full / quick (a section is skipped past the budget)
COST = {"training": (120, 35), "loop_overhead": (45, 20), "training_20m": (70, 25), "cli_start": (20, 8),
        "config_refusal": (20, 8), "checkpoint_io": (30, 15), "packing": (80, 45), "scaling": (110, 60),
        "fsdp_memory": (420, 300), "activation_memory": (180, 180), "precision": (90, 60),
        "model_parallel": (180, 135)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no sequence-length sweep")
    parser.add_argument("--only", default=None, help=f"comma-separated sections: {', '.join(SECTIONS)}")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (OMP_NUM_THREADS; default 1: on a shared 2-core machine a "
                             "2-thread run waits on whichever core is busy; 0 = torch's default)")
    parser.add_argument("--sequential", action="store_true",
                        help="run the sides of a comparison one after another instead of at the same time")
    parser.add_argument("--budget", type=float, default=1200, help="seconds; sections that would end later are skipped")
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
                data = SECTIONS[name](runner, rows, args.quick, results["sections"])
            else:
                data = SECTIONS[name](runner, rows, args.quick)
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
