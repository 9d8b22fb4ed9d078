"""`automodel plot`: a PNG of a finished run's curves; runs overlay; matplotlib stays an optional, lazy import."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from automodel.cli.commands.plot import MISSING_EXTRA, load_run
from automodel.cli.main import main

TINY_RUN = """\
step_scheduler: {max_steps: 6, val_check_interval: 3, checkpoint_interval: 6, log_interval: 1}
model:
  _target_: automodel_llm.AutoModelForCausalLM.from_config
  config: ${pkg:automodel_llm}/examples/assets/tiny_llama/config.json
  hidden_size: 32
  intermediate_size: 64
  num_hidden_layers: 1
  num_attention_heads: 2
  num_key_value_heads: 2
  head_dim: 16
tokenizer:
  pretrained_model_name_or_path: ${pkg:automodel_llm}/examples/assets/tiny_tokenizer
dataset:
  _target_: automodel_llm.datasets.SquadDataset
  dataset_name: ${pkg:automodel_llm}/examples/assets/tiny_squad
  limit_dataset_samples: 32
validation_dataset:
  _target_: automodel_llm.datasets.SquadDataset
  dataset_name: ${pkg:automodel_llm}/examples/assets/tiny_squad
  split: validation
  limit_dataset_samples: 8
dataloader: {batch_size: 4}
optimizer: {_target_: torch.optim.AdamW, lr: 3.0e-3}
lr_scheduler: {_target_: automodel.optim.CosineAnnealingWarmup, warmup_steps: 2}
"""


def run_main(*args) -> tuple[int, str]:
    from automodel.plugins.manager import reset_plugin_manager

    reset_plugin_manager(None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real (tiny) training run: 6 steps, validation at 3 and 6, its checkpoint_dir."""
    pytest.importorskip("automodel_llm")
    root = tmp_path_factory.mktemp("plot")
    (root / "tiny.yaml").write_text(TINY_RUN)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    code, output = run_main("finetune", "llm", "-c", root / "tiny.yaml", "--checkpoint.checkpoint_dir", root / "run")
    assert code == 0, output
    return root / "run"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_writes_a_png_for_a_finished_run(finished_run, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    code, output = run_main("plot", finished_run, "-o", out)
    assert code == 0, output
    assert f"wrote {out}" in output
    assert "run: 6 training samples, last step 6 loss" in output and "validation loss" in output
    width, height = png_size(out)
    assert (width, height) == (1320, 825)
    from matplotlib.image import imread

    pixels = imread(out)
    assert pixels.shape[:2] == (825, 1320)
    # Drawn, not blank: the four panels hold coloured curves (matplotlib's C0 blue is (31, 119, 180)).
    blue = ((abs(pixels[..., 0] - 31 / 255) < 0.05) & (abs(pixels[..., 1] - 119 / 255) < 0.05)
            & (abs(pixels[..., 2] - 180 / 255) < 0.05))
    assert blue.sum() > 500, blue.sum()


def test_default_output_is_inside_the_run_and_a_checkpoint_means_its_run(finished_run):
    pytest.importorskip("matplotlib")
    code, output = run_main("plot", finished_run / "epoch_0_step_6")
    assert code == 0, output
    assert (finished_run / "curves.png").is_file()
    png_size(finished_run / "curves.png")


def test_compare_overlays_runs_with_distinct_labels(finished_run, tmp_path):
    pytest.importorskip("matplotlib")
    other = tmp_path / "other" / "run"  # same directory name as the finished run: labels must still differ
    other.mkdir(parents=True)
    records = [{"step": s, "epoch": 0, "loss": 7.0 - s, "grad_norm": 1.0, "lr": 1e-3, "mem": 0.1, "tps": 100.0 * s,
                "mfu": None} for s in range(1, 9)]
    (other / "training.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "compare.png"
    code, output = run_main("plot", finished_run, "--compare", other / "training.jsonl", "-o", out)
    assert code == 0, output
    png_size(out)
    labels = [line.split(":")[0] for line in output.splitlines() if "training samples" in line]
    assert len(labels) == 2 and len(set(labels)) == 2, labels
    assert labels[1].endswith("other/run")


def test_load_run_resumed_runs_partial_lines_and_validation_sets(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": 9.9},
             {"step": 3, "loss": 2.0}, {"step": 4, "loss": None}]  # step 3 re-logged after a resume
    (run / "training.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "lo')
    (run / "validation.jsonl").write_text(
        json.dumps({"step": 2, "name": "validation", "val_loss": 2.7}) + "\n"
        + json.dumps({"step": 2, "name": "held_out", "val_loss": 3.1}) + "\n")
    loaded = load_run(run)
    assert [r["step"] for r in loaded.train] == [1, 2, 3, 4]
    assert loaded.train[2]["loss"] == 2.0
    assert sorted(loaded.val) == ["held_out", "validation"]
    assert load_run(run / "validation.jsonl").train == loaded.train  # a jsonl brings its sibling along


def test_errors_are_clear(tmp_path, monkeypatch):
    code, output = run_main("plot", tmp_path)
    assert code == 2 and "holds no training.jsonl or validation.jsonl" in output
    code, output = run_main("plot", tmp_path / "missing")
    assert code == 2 and "does not exist" in output
    (tmp_path / "training.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    code, output = run_main("plot", tmp_path, "-o", tmp_path / "x.jpg")
    assert code == 2 and "the output is a PNG" in output
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the optional extra were not installed
    code, output = run_main("plot", tmp_path, "-o", tmp_path / "x.png")
    assert code == 1
    assert MISSING_EXTRA in output and "pip install 'automodel-core[plot]'" in output
    assert not (tmp_path / "x.png").exists()


def test_help_imports_neither_matplotlib_nor_torch():
    code = textwrap.dedent("""
        import sys
        from automodel.cli.main import main
        assert main(["--help"]) == 0
        assert main(["plot", "--help"]) == 0
        assert main(["new", "--help"]) == 0
        heavy = sorted(m for m in ("matplotlib", "torch", "transformers") if m in sys.modules)
        print("HEAVY", heavy)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOMODEL_")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout[-500:]
    assert "automodel plot" not in result.stderr
