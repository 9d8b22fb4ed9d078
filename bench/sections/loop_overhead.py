"""Benchmark 1 in one process: the engine's loop and the hand loop interleaved step by step (bench/interleave.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from harness import BENCH, PY, TINY_CONFIG, TINY_SQUAD, TOKENIZER, WORK, Runner, run_proc
from report import Row, check
from stats import median


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
