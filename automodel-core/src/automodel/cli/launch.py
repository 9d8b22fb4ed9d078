"""Re-running the current command under ``torch.distributed.run`` for ``--nproc-per-node N``."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

LAUNCH_OPTIONS = ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port")


def strip_launch_options(argv: list[str]) -> list[str]:
    """The command line without the launcher's own options (each rank runs it in-process)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in LAUNCH_OPTIONS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def torchrun_command(launch: dict[str, Any], argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={launch['nproc_per_node']}"]
    nnodes = launch.get("nnodes") or 1
    cmd.append(f"--nnodes={nnodes}")
    if nnodes > 1:
        cmd += [f"--node-rank={launch.get('node_rank') or 0}"]
    cmd += [f"--master-addr={launch.get('master_addr') or 'localhost'}",
            f"--master-port={launch.get('master_port') or 29500}"]
    return cmd + ["-m", "automodel.cli.main", *strip_launch_options(argv)]


def relaunch_under_torchrun(launch: dict[str, Any]) -> int:
    cmd = torchrun_command(launch, sys.argv[1:])
    torchrun = cmd[1:cmd.index("automodel.cli.main") - 1]
    print(f"launching {launch['nproc_per_node']} processes: {' '.join(torchrun)} ...", file=sys.stderr)
    return subprocess.call(cmd, env=os.environ.copy())
