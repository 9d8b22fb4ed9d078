"""`--slurm` (issue 21): a `slurm:` string that would break out of its #SBATCH line is refused at validation with
its key, and the command line in the generated script reaches srun as the same words, whatever they hold. The
script is run with stand-ins for `scontrol` and `srun` (no Slurm here) that record their arguments.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import reliability_helpers as h
import security_helpers as s

from automodel.testing import write_yaml


def _config(cwd: Path, slurm: dict) -> Path:
    config = h.run_config(h.write_tiny_llama(cwd / "model"), step_scheduler={"max_steps": 1})
    config["slurm"] = {"script": str(cwd / "job.sbatch"), **slurm}
    return write_yaml(cwd / "cfg.yaml", config)


@pytest.mark.parametrize("key,value", [
    ("job_name", "train\ntouch {marker}"),
    ("job_name", "train --wrap='touch {marker}'"),
    ("partition", "gpu\rtouch {marker}"),
    ("account", "acct;touch {marker}"),
    ("output", "out.log\n#!/bin/sh"),
    ("time", "04:00:00 $(touch {marker})"),
    ("script", "job\n.sbatch"),
])
def test_a_slurm_string_that_leaves_its_line_is_refused(cwd, key, value):
    value = value.format(marker=s.marker(cwd))
    rc, text = s.run_main("finetune", "llm", "-c", _config(cwd, {key: value}), "--slurm")
    assert rc == 2, text
    assert f"slurm.{key}: " in text and "Traceback" not in text, text
    assert not (cwd / "job.sbatch").exists() and not s.marker(cwd).exists()
    rc, text = s.run_main("validate", "finetune", "llm", "-c", _config(cwd, {key: value}))
    assert rc == 2 and f"slurm.{key}: " in text


def test_every_bad_slurm_field_is_reported_at_once(cwd):
    rc, text = s.run_main("validate", "finetune", "llm", "-c",
                     _config(cwd, {"job_name": "a\nb", "partition": "p q", "nodes": 0, "gpus_per_node": 0}))
    assert rc == 2 and "(4 problems)" in text, text
    for key in ("slurm.job_name", "slurm.partition", "slurm.nodes", "slurm.gpus_per_node"):
        assert f"  - {key}: " in text


def _stand_ins(directory: Path) -> Path:
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    record = f"for a in \"$@\"; do printf '%s\\0' \"$a\"; done > {directory}/srun.args"
    (bin_dir / "srun").write_text(f"#!/bin/sh\n{record}\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def test_the_generated_script_passes_a_hostile_command_line_as_words(cwd):
    hostile = f"x$(touch {s.marker(cwd)})`touch {s.marker(cwd)}`\ntouch {s.marker(cwd)}; 'q\"'"
    config = _config(cwd, {"job_name": "my-job", "partition": "gpu,debug", "time": "1-00:00:00",
                           "output": "logs/slurm-%j.out"})
    argv = ["finetune", "llm", "-c", config, "--slurm", "--ci.note", hostile, "--allow-target", "amt_mine",
            "--trust-remote-code"]
    written = subprocess.run(h.cli_command(*argv), cwd=cwd, env=h.cli_env(), capture_output=True, text=True,
                             timeout=120)  # the script holds the real process's command line
    assert written.returncode == 0, written.stderr
    script = (cwd / "job.sbatch").read_text()
    assert "#SBATCH --job-name=my-job" in script and "#SBATCH --partition=gpu,debug" in script
    bin_dir = _stand_ins(cwd)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node1",
           "SLURM_JOB_ID": "7"}
    result = subprocess.run(["bash", str(cwd / "job.sbatch")], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert not s.marker(cwd).exists()
    words = (cwd / "srun.args").read_text().split("\0")[:-1]
    tail = words[words.index("automodel.cli.main") + 1:]
    assert tail == ["finetune", "llm", "-c", str(config), "--ci.note", hostile, "--allow-target", "amt_mine",
                    "--trust-remote-code"]
