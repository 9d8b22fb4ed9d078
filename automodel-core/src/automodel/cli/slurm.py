"""``--slurm``: write an sbatch script that runs the same command under torchrun on every node."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from automodel.cli.launch import strip_launch_options


@dataclass
class SlurmConfig:
    job_name: str = field(default="automodel", metadata={"help": "#SBATCH --job-name"})
    nodes: int = field(default=1, metadata={"help": "#SBATCH --nodes"})
    gpus_per_node: int = field(default=8, metadata={"help": "processes (GPUs) per node for torchrun"})
    partition: str | None = field(default=None, metadata={"help": "#SBATCH --partition"})
    account: str | None = field(default=None, metadata={"help": "#SBATCH --account"})
    time: str = field(default="04:00:00", metadata={"help": "#SBATCH --time"})
    master_port: int = field(default=29500, metadata={"help": "rendezvous port on the first node"})
    output: str = field(default="slurm-%j.out", metadata={"help": "#SBATCH --output"})
    script: str = field(default="automodel.sbatch", metadata={"help": "where the script is written"})

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("slurm.nodes and slurm.gpus_per_node must be >= 1")


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
