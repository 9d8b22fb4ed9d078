"""A plain upstream-style ``lr_scheduler:`` section through the CLI: the logged rates follow its formulas, a resumed
run continues them, and an unknown style is refused at validation with the supported ones."""

from __future__ import annotations

import math

from automodel.testing import read_jsonl, run_cli, run_cli_inprocess

# WSD: warmup 2 steps from init_lr, stable, then a cosine decay over the last 3 of 8 steps to min_lr.
UPSTREAM_SCHEDULE = {"_target_": None, "warmup_steps": None, "min_lr": 1.0e-4, "lr_decay_style": "WSD",
                     "lr_warmup_steps": 2, "init_lr": 1.0e-3, "wsd_decay_steps": 3, "lr_wsd_decay_style": "cosine",
                     "start_wd": 0.0, "end_wd": 0.1, "wd_incr_style": "linear"}
MAX_LR = 3.0e-3  # the optimizer's lr in the tiny config


def expected_lr(step: int) -> float:
    n = step - 1  # the update of step s trains at the rate after s - 1 steps
    if n <= 2:
        return 1.0e-3 + (MAX_LR - 1.0e-3) * n / 2
    if n <= 8 - 3:
        return MAX_LR
    return 1.0e-4 + (MAX_LR - 1.0e-4) * 0.5 * (1 + math.cos(math.pi * (n - 5) / 3))


def test_upstream_schedule_drives_the_logged_lr_and_resumes(make_config, tmp_path):
    config = make_config(step_scheduler={"max_steps": 8, "checkpoint_interval": 4},
                         lr_scheduler=UPSTREAM_SCHEDULE)
    result = run_cli("finetune", "llm", "-c", config, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    full = read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    assert [r["step"] for r in full] == list(range(1, 9))
    for record in full:
        assert math.isclose(record["lr"], expected_lr(record["step"]), rel_tol=1e-6), record

    resumed = run_cli("finetune", "llm", "-c", config, "--checkpoint.checkpoint_dir", tmp_path / "again",
                      "--restore_from.path", tmp_path / "ckpt" / "epoch_0_step_4", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    tail = read_jsonl(tmp_path / "again" / "training.jsonl")
    assert [r["step"] for r in tail] == [5, 6, 7, 8]
    for record, reference in zip(tail, full[4:], strict=True):
        assert record["lr"] == reference["lr"]
        assert math.isclose(record["loss"], reference["loss"], rel_tol=1e-5), (record, reference)


def test_unknown_decay_style_is_refused_with_the_supported_ones(make_config, tmp_path):
    config = make_config(lr_scheduler={"_target_": None, "warmup_steps": None, "min_lr": None,
                                       "lr_decay_style": "polynomial"})
    result = run_cli_inprocess("validate", "-c", config, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert ("lr_scheduler.lr_decay_style: 'polynomial' is not supported; use one of: cosine, linear, WSD, "
            "inverse-square-root, constant") in result.stderr
