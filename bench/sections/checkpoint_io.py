"""Benchmark 4: the engine's checkpoint save and load against raw safetensors (bench/ckpt_io.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import BENCH, CONFIGS, PY, WORK, Runner, millions, run_proc
from report import Row, check, fmt
from stats import median, ratio


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
