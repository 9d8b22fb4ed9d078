"""Helpers for the distributed tests: launch N gloo ranks of a scenario in parallel_workers.py, tiny Llama models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from automodel.testing import free_port

WORKERS = Path(__file__).with_name("parallel_workers.py")


def run_all_scenarios(tmp: Path) -> dict[str, Any]:
    """Prepare the inputs (HF checkpoints, a one-process sharded checkpoint), then run ``scenario_all`` on two gloo
    ranks and, beside it, the one-process memory control. The session fixture ``two_ranks`` returns this."""
    import torch
    from parallel_workers import local_model, memory_config, tiny_config, train
    from transformers import AutoModelForCausalLM

    from automodel.training.parallel.sharded_checkpoint import save_sharded_state

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(tmp / "base", max_shard_size="20KB")
    model = local_model(tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    one_process = {"steps_1_2": train(model, 2, optimizer=optimizer)}
    save_sharded_state(tmp / "one_process", model, optimizer, max_file_bytes=20_000)
    one_process["steps_3_4"] = train(model, 2, first_step=2, optimizer=optimizer)
    big = AutoModelForCausalLM.from_config(memory_config())
    model_bytes = sum(p.numel() * p.element_size() for p in big.parameters())
    big.save_pretrained(tmp / "memory_base", max_shard_size=f"{model_bytes // 8 // 1000}KB")
    del big
    memory = {"base": tmp / "memory_base", "model_bytes": model_bytes}
    args = {"memory": memory, "fsdp": {"base": tmp / "base"}, "checkpoint": {"one_process": tmp / "one_process"}}
    ranks, one = launch_together([("all", 2, tmp / "ranks", args), ("memory", 0, tmp / "memory_one", memory)])
    return {"dir": tmp / "ranks", "base": tmp / "base", "one_process": one_process, "model_bytes": model_bytes,
            "memory_one": one[0], "ranks": ranks}


def run_model_parallel_scenarios(tmp_path_factory: Any) -> dict[str, Any]:
    """``scenario_two`` on two gloo ranks and ``scenario_four`` on four, launched together once for all workers,
    then this worker's single-process references (tied and untied tiny Llama, Qwen3). The session fixture
    ``model_parallel_ranks`` returns this."""
    from model_parallel_workers import mp_config, qwen3_config, reference

    from automodel.testing import once_per_session

    def launch_both(tmp: Path) -> dict[str, Any]:
        two, four = launch_together([("two", 2, tmp / "two", {}), ("four", 4, tmp / "four", {})], timeout=600,
                                    workers=WORKERS.with_name("model_parallel_workers.py"))
        return {"dir": tmp, "two": two, "four": four}

    launched = once_per_session(tmp_path_factory, "model_parallel", launch_both)
    (tied, tied_state), (untied, untied_state) = reference(mp_config()), reference(mp_config(tied=False))
    return {**launched, "tied": tied, "tied_state": tied_state, "untied": untied, "untied_state": untied_state,
            "qwen3": reference(qwen3_config(), steps=3)[0]}


def launch(scenario: str, world: int, out: Path, timeout: float = 300, **args: Any) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` processes (one torch thread each); each rank's JSON result, rank order.

    ``world == 0`` runs one plain process without a process group (no RANK / WORLD_SIZE in its environment)."""
    return launch_together([(scenario, world, out, args)], timeout)[0]


def launch_together(jobs: list[tuple[str, int, Path, dict[str, Any]]], timeout: float = 300,
                    workers: Path = WORKERS) -> list[list[dict[str, Any]]]:
    """Several launches at the same time (``(scenario, world, out, args)`` each) of scenarios in the script
    ``workers``; their results in order."""
    started = [_start(workers, scenario, world, out, args) for scenario, world, out, args in jobs]
    deadline = time.monotonic() + timeout
    codes = [_wait_group([proc for proc, _ in procs], deadline) for procs in started]
    failed = []
    for procs, group_codes, (_, _, out, _) in zip(started, codes, jobs, strict=True):
        for rank, ((_, log), code) in enumerate(zip(procs, group_codes, strict=True)):
            log.close()
            if code != 0:
                failed.append(f"{out} rank {rank} exit {code}:\n" + (out / f"rank{rank}.log").read_text()[-4000:])
    if failed:
        raise AssertionError("\n".join(failed))
    return [[json.loads((out / f"rank{rank}.json").read_text()) for rank in range(max(world, 1))]
            for _, world, out, _ in jobs]


def _wait_group(procs: list[subprocess.Popen], deadline: float) -> list[int | str]:
    """Each process's exit code; once one rank fails (or the deadline passes) the others are killed rather than
    left waiting for a peer that will never come ("killed" / "timeout" stand for their codes)."""
    codes: list[int | str | None] = [None] * len(procs)
    while any(code is None for code in codes):
        for index, proc in enumerate(procs):
            if codes[index] is None:
                codes[index] = proc.poll()
        failed = any(code not in (None, 0) for code in codes)
        if failed or time.monotonic() > deadline:
            for index, proc in enumerate(procs):
                if codes[index] is None:
                    proc.kill()
                    proc.wait()
                    codes[index] = "killed" if failed else "timeout"
        else:
            time.sleep(0.2)
    return codes


def _start(workers: Path, scenario: str, world: int, out: Path, args: dict[str, Any]
           ) -> list[tuple[subprocess.Popen, Any]]:
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
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed once the process ends
        procs.append((subprocess.Popen([sys.executable, str(workers), scenario, json.dumps(args, default=str),
                                        str(out / f"rank{rank}.json")], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    return procs
