"""``automodel plot``: a PNG of a run's curves (loss, validation loss, learning rate, tokens/s, grad norm).

Reads the metric files the training loop writes (``<checkpoint_dir>/training.jsonl`` and ``validation.jsonl``,
DESIGN §9). matplotlib is an optional extra (``pip install 'automodel-core[plot]'``), imported only when the
command runs, so ``automodel --help`` stays fast.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from automodel.errors import AutomodelError, UsageError

TRAINING, VALIDATION = "training.jsonl", "validation.jsonl"
MISSING_EXTRA = ("automodel plot needs matplotlib, which is an optional extra: "
                 "pip install 'automodel-core[plot]' (or pip install matplotlib)")


@dataclass
class Run:
    """One run's metrics: training samples by step, validation records by (name, step)."""

    label: str
    root: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    val: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # a run killed mid-write leaves a partial last line
            raise UsageError(f"{path}:{number}: not a JSON line") from None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A resumed run appends to the same file: for a step logged twice the later record wins."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def _metric_files(path: Path) -> tuple[Path, list[Path]]:
    """The run directory and the metric files for PATH (a checkpoint_dir, a checkpoint inside it, or a jsonl)."""
    if path.is_file():
        files = [path]
        if path.name == TRAINING and (path.parent / VALIDATION).is_file():
            files.append(path.parent / VALIDATION)
        elif path.name == VALIDATION and (path.parent / TRAINING).is_file():
            files.insert(0, path.parent / TRAINING)
        return path.parent, files
    for root in (path, path.parent):  # epoch_E_step_S/ inside a checkpoint_dir means that run
        files = [root / name for name in (TRAINING, VALIDATION) if (root / name).is_file()]
        if files:
            return root, files
    raise UsageError(f"'{path}' holds no {TRAINING} or {VALIDATION}: pass a run's checkpoint.checkpoint_dir "
                     "or one of its .jsonl files")


def load_run(path: Path) -> Run:
    if not path.exists():
        raise UsageError(f"'{path}' does not exist")
    root, files = _metric_files(path)
    run = Run(label=root.name or str(root), root=root, files=files)
    train, val = [], []
    for file in files:
        for record in _read_jsonl(file):
            (val if "val_loss" in record else train).append(record)
    run.train = _last_per_step(train)
    names: dict[str, list[dict[str, Any]]] = {}
    for record in val:
        names.setdefault(str(record.get("name", "validation")), []).append(record)
    run.val = {name: _last_per_step(records) for name, records in names.items()}
    if not run.train and not run.val:
        raise UsageError(f"{', '.join(map(str, files))}: no metric records yet (is the run logging? "
                         "step_scheduler.log_interval sets how often)")
    return run


def _labels(runs: list[Run]) -> None:
    """Distinct legend labels: the directory name, or more of its path where two runs share one."""
    for depth in range(1, 6):
        labels = [str(Path(*r.root.resolve().parts[-depth:])) for r in runs]
        if len(set(labels)) == len(labels):
            break
    for run, label in zip(runs, labels, strict=True):
        run.label = label


def _values(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(record["step"])
            values.append(float(value) if math.isfinite(value) else math.nan)
        elif key in record:  # None: a non-finite value was logged; leave a gap
            steps.append(record["step"])
            values.append(math.nan)
    return steps, values


def render_png(runs: list[Run], output: Path, title: str | None = None) -> Path:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise AutomodelError(MISSING_EXTRA) from None

    figure = Figure(figsize=(12, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2, sharex=True)
    panels = {"loss": axes[0][0], "lr": axes[0][1], "tps": axes[1][0], "grad_norm": axes[1][1]}
    titles = {"loss": "loss (training solid, validation dashed)", "lr": "learning rate", "tps": "tokens / s",
              "grad_norm": "gradient norm (before clipping)"}
    colors = [f"C{i}" for i in range(10)]
    plotted = dict.fromkeys(panels, False)
    for index, run in enumerate(runs):
        color = colors[index % len(colors)]
        for key, ax in panels.items():
            steps, values = _values(run.train, key)
            if steps:
                ax.plot(steps, values, color=color, linewidth=1.6, marker="." if len(steps) <= 30 else None,
                        label=f"{run.label} training" if key == "loss" else run.label)
                plotted[key] = True
        markers = "osD^v"
        for number, (name, records) in enumerate(run.val.items()):
            steps, values = _values(records, "val_loss")
            if steps:
                shown = "validation" if name == "validation" else f"validation [{name}]"
                panels["loss"].plot(steps, values, color=color, linestyle="--", marker=markers[number % 5],
                                    markersize=4, linewidth=1.4, label=f"{run.label} {shown}")
                plotted["loss"] = True
    for key, ax in panels.items():
        ax.set_title(titles[key], fontsize=11)
        ax.grid(True, alpha=0.3)
        if not plotted[key]:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")
        elif key == "loss" or len(runs) > 1:
            ax.legend(fontsize=8, loc="best")
    panels["lr"].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in axes[1]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(title or "  vs  ".join(r.label for r in runs), fontsize=12)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, format="png")
    return output


def _summary(run: Run) -> str:
    parts = [f"{run.label}: {len(run.train)} training samples"]
    if run.train:
        last = run.train[-1]
        parts.append(f"last step {last['step']}" + (f" loss {last['loss']:.4f}"
                                                    if isinstance(last.get("loss"), float) else ""))
    for name, records in run.val.items():
        if records and isinstance(records[-1].get("val_loss"), float):
            parts.append(f"{name} loss {records[-1]['val_loss']:.4f} at step {records[-1]['step']}")
    return ", ".join(parts)


@click.command("plot")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--compare", multiple=True, type=click.Path(path_type=Path),
              help="another run to overlay (repeatable; extra RUNS are overlaid too)")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG to write (default: <first run's checkpoint_dir>/curves.png)")
@click.option("--title", default=None, help="figure title (default: the runs' names)")
def plot(runs: tuple[Path, ...], compare: tuple[Path, ...], output: Path | None, title: str | None) -> None:
    """Write a PNG of RUN's training and validation loss, learning rate, tokens/s and grad norm by step.

    RUN is a checkpoint.checkpoint_dir (or a checkpoint inside it, or a training.jsonl / validation.jsonl).
    `--compare OTHER` overlays more runs. Needs the optional extra: pip install 'automodel-core[plot]'.
    """
    loaded = [load_run(path) for path in (*runs, *compare)]
    _labels(loaded)
    output = output or loaded[0].root / "curves.png"
    if output.suffix.lower() != ".png":
        raise UsageError(f"-o {output}: the output is a PNG; name it *.png")
    render_png(loaded, output, title)
    for run in loaded:
        click.echo(_summary(run))
    click.echo(f"wrote {output}")
