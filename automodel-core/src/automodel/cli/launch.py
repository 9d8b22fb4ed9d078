"""Re-running the current command under ``torch.distributed.run`` (torchrun; :mod:`automodel.cli.torchrun` runs it).

Every multi-process or multi-node form is a real distributed run: ``--nproc-per-node N`` (N > 1), and any of
``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port`` and the rendezvous options (also with one
process per node), relaunch the command under torchrun; each rank then runs it in-process without these options.
Without ``--master-addr`` / ``--master-port`` the config's ``dist_env.master_addr`` / ``master_port`` are the
rendezvous address.
"""

from __future__ import annotations

import sys
from typing import Any

import click

# click's parameter names of the launcher's options, and the torchrun flag of each (the CLI spells them the same)
LAUNCH_FLAGS = {"nproc_per_node": "--nproc-per-node", "nnodes": "--nnodes", "node_rank": "--node-rank",
                "master_addr": "--master-addr", "master_port": "--master-port", "rdzv_backend": "--rdzv-backend",
                "rdzv_endpoint": "--rdzv-endpoint", "rdzv_id": "--rdzv-id"}
LAUNCH_OPTIONS = tuple(LAUNCH_FLAGS.values())
_HELP = {"nproc_per_node": (int, "processes per node (torchrun)"), "nnodes": (int, "number of nodes (torchrun)"),
         "node_rank": (int, "this node's rank (torchrun)"), "master_addr": (str, "rendezvous address (torchrun; "
                                                                              "default dist_env.master_addr)"),
         "master_port": (int, "rendezvous port (torchrun; default dist_env.master_port)"),
         "rdzv_backend": (str, "rendezvous backend, e.g. c10d (torchrun)"),
         "rdzv_endpoint": (str, "rendezvous host:port (torchrun)"), "rdzv_id": (str, "rendezvous job id (torchrun)")}


def launch_params() -> list[click.Option]:
    """The launcher's options for a click command (each arrives as a keyword argument named as in LAUNCH_FLAGS)."""
    return [click.Option([flag], type=_HELP[name][0], default=None, help=_HELP[name][1])
            for name, flag in LAUNCH_FLAGS.items()]


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


def needs_torchrun(launch: dict[str, Any]) -> bool:
    """Whether the options ask for a distributed run: several processes, or any node / rendezvous option."""
    if (launch.get("nproc_per_node") or 1) > 1:
        return True
    return any(launch.get(name) is not None for name in LAUNCH_FLAGS if name != "nproc_per_node")


def planned_world(launch: dict[str, Any]) -> tuple[int, str]:
    """The world size these options launch and how it was worked out (what validation checks the mesh against)."""
    nproc, nnodes = launch.get("nproc_per_node") or 1, launch.get("nnodes") or 1
    return nproc * nnodes, f"--nproc-per-node {nproc} x --nnodes {nnodes}"


def torchrun_command(launch: dict[str, Any], argv: list[str], master_addr: str = "localhost",
                     master_port: int = 29500) -> list[str]:
    """torchrun's command line; ``master_addr`` / ``master_port`` (the config's ``dist_env``) stand in for the
    options the user did not give."""
    settings = {**launch, "nproc_per_node": launch.get("nproc_per_node") or 1, "nnodes": launch.get("nnodes") or 1,
                "master_addr": launch.get("master_addr") or master_addr,
                "master_port": launch.get("master_port") or master_port}
    cmd = [sys.executable, "-m", "automodel.cli.torchrun"]
    cmd += [f"{flag}={settings[name]}" for name, flag in LAUNCH_FLAGS.items() if settings.get(name) is not None]
    return cmd + ["-m", "automodel.cli.main", *strip_launch_options(argv)]


def relaunch_under_torchrun(launch: dict[str, Any], master_addr: str, master_port: int) -> int:
    """Run torchrun's launcher in this process (it starts the ranks as new processes): the command is the one
    :func:`torchrun_command` writes, without a second interpreter importing torch again only to launch them."""
    from automodel.cli import torchrun

    cmd = torchrun_command(launch, sys.argv[1:], master_addr, master_port)
    world, how = planned_world(launch)
    flags = " ".join(arg for arg in cmd[3:] if arg.startswith("--") and arg.split("=")[0] in LAUNCH_OPTIONS)
    print(f"launching {world} processes in all ({how}) under torch.distributed.run {flags}", file=sys.stderr)
    return torchrun.main(cmd[3:])
