"""What a run writes to stderr when stderr is not a terminal (CI logs, nohup, SLURM): plain lines, one progress
line per log interval, no carriage-return frames, no third-party noise (automodel-core/tests/test_progress.py
covers the terminal and AUTOMODEL_DEBUG)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from automodel.noise import LOG_NOISE
from automodel.testing import AUTOMODEL_BIN, OFFLINE

STEPS, LOG_INTERVAL = 6, 2
PROGRESS_LINE = re.compile(r"^train step (\d+)/6: loss \d+\.\d{4}, lr \d\.\d\de[-+]\d\d, \d+ tokens/s, "
                           r"elapsed \d+:\d\d:\d\d, ETA \d+:\d\d:\d\d$")


def run_example(cwd, **env_extra: str) -> subprocess.CompletedProcess:
    """The tiny LLM example through the console script, stderr a pipe; the environment a user's shell has (no
    TRANSFORMERS_NO_ADVISORY_WARNINGS, no AUTOMODEL_*), offline."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AUTOMODEL_") and k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    env.update(HF_HUB_OFFLINE=OFFLINE["HF_HUB_OFFLINE"], HF_DATASETS_OFFLINE=OFFLINE["HF_DATASETS_OFFLINE"],
               **env_extra)
    command = [str(AUTOMODEL_BIN)] if AUTOMODEL_BIN.exists() else [sys.executable, "-m", "automodel.cli.main"]
    args = ["finetune", "llm", "-c", "llm/tiny_squad", "--step_scheduler.max_steps", STEPS,
            "--step_scheduler.log_interval", LOG_INTERVAL, "--step_scheduler.val_check_interval", STEPS,
            "--dataloader.batch_size", 8, "--validation_dataset.limit_dataset_samples", 8,
            "--eval_generation.num_examples", 2, "--checkpoint.checkpoint_dir", cwd / "ckpt"]
    result = subprocess.run([*command, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_non_terminal_run_writes_one_plain_progress_line_per_log_interval_and_no_noise(tmp_path):
    err = run_example(tmp_path).stderr
    assert "\r" not in err
    progress = [line for line in err.splitlines() if line.startswith("train step")]
    assert len(progress) == STEPS // LOG_INTERVAL, progress
    assert all(PROGRESS_LINE.match(line) for line in progress), progress
    assert [int(PROGRESS_LINE.match(line)[1]) for line in progress] == [2, 4, 6]
    assert progress[-1].endswith("ETA 0:00:00")
    for logger, text in LOG_NOISE:
        assert text not in err, f"{logger}: {text!r} reached the log"
    assert "host memory" not in err  # an internal tuning line: AUTOMODEL_DEBUG=1 only
    assert "validation [validation] step 6" in err and "checkpoint: " in err  # what the user needs stays
