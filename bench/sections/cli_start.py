"""Benchmark 3: how fast the CLI starts (`--help`, `recipes`, `plugins`) and which heavy packages it imports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from harness import AUTOMODEL, PY, WORK, Runner, run_proc
from report import Row, check, fmt
from stats import median, ratio, rotation


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
