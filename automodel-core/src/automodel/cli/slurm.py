"""``--slurm``: write an sbatch script that runs the same command under torchrun on every node.

The ``slurm`` section is untrusted like the rest of the config: its strings become ``#SBATCH`` lines, so they are
checked at validation (a newline would start a line of its own, which bash runs) and the command line is quoted.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from automodel.cli.launch import strip_launch_options
from automodel.config.schema import FieldErrors, require_positive

# What an #SBATCH value may hold: names, paths, times and sbatch's %-patterns; no spaces, quotes or control
# characters (sbatch splits the line on spaces; a newline ends the directive and starts a shell line).
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9._:@%/+,=~-]+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
        bad = {}
        for name in ("job_name", "partition", "account", "time", "output"):
            value = getattr(self, name)
            if value is not None and not _SBATCH_VALUE.match(value):
                bad[name] = (f"{value!r} cannot go into an #SBATCH line: use letters, digits and . _ : @ % / + , = ~ - "
                             "only (no spaces, quotes or control characters such as a newline)")
        if _CONTROL.search(self.script):
            bad["script"] = f"{self.script!r} holds a control character; name a plain file path"
        try:
            require_positive(self, "nodes", "gpus_per_node", "master_port")
        except FieldErrors as err:
            bad.update(err.errors)
        if bad:
            raise FieldErrors(bad)


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
