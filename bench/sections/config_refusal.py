"""Benchmark 8: how fast a config with mistakes is refused (exit 2) by `validate` and by a training route."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import AUTOMODEL, LLM_PKG, WORK, Runner, run_proc
from report import Row, check, fmt
from stats import median, rotation

from sections.cli_start import heavy_imports


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
