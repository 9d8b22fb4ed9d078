"""Helpers for the distributed tests: launch N gloo ranks of a scenario in parallel_workers.py, tiny Llama models."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKERS = Path(__file__).with_name("parallel_workers.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(scenario: str, world: int, out: Path, timeout: float = 300, **args: Any) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` processes (one torch thread each); each rank's JSON result, rank order.

    ``world == 0`` runs one plain process without a process group (no RANK / WORLD_SIZE in its environment)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(max(world, 1)):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        if world:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        else:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(key, None)
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below, after the process ends
        procs.append((subprocess.Popen([sys.executable, str(WORKERS), scenario, json.dumps(args, default=str),
                                        str(out / f"rank{rank}.json")], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append(f"rank {rank} exit {code}:\n" + (out / f"rank{rank}.log").read_text()[-4000:])
    if failed:
        raise AssertionError("\n".join(failed))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(max(world, 1))]
