"""``--slurm``: write an sbatch script that runs the same command under torchrun on every node.

The ``slurm`` section is untrusted like the rest of the config: its strings become ``#SBATCH`` lines, so they are
checked at validation (``SlurmConfig`` in training/sections.py: a newline would start a line of its own, which
bash runs) and the command line is quoted.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from automodel.cli.launch import strip_launch_options
from automodel.training.sections import SlurmConfig


def sbatch_script(cfg: SlurmConfig, argv: list[str]) -> str:
    command = [arg for arg in strip_launch_options(argv) if arg != "--slurm"]
    lines = ["#!/bin/bash", f"#SBATCH --job-name={cfg.job_name}", f"#SBATCH --nodes={cfg.nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={cfg.gpus_per_node}",
             f"#SBATCH --time={cfg.time}", f"#SBATCH --output={cfg.output}"]
    lines += [f"#SBATCH --{key}={value}" for key, value in (("partition", cfg.partition), ("account", cfg.account))
              if value]
    lines += [
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "srun python -m torch.distributed.run \\",
        f"  --nnodes={cfg.nodes} --nproc-per-node={cfg.gpus_per_node} \\",
        f'  --rdzv-backend=c10d --rdzv-endpoint="$head_node:{cfg.master_port}" --rdzv-id="$SLURM_JOB_ID" \\',
        f"  -m automodel.cli.main {shlex.join(command)}",
    ]
    return "\n".join(lines) + "\n"


def write_sbatch(cfg: SlurmConfig | None, argv: list[str] | None = None) -> Path:
    cfg = cfg or SlurmConfig()
    path = Path(cfg.script)
    path.write_text(sbatch_script(cfg, list(sys.argv[1:] if argv is None else argv)), encoding="utf-8")
    path.chmod(0o755)
    return path
