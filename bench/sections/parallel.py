"""Benchmarks 9-12 (issues 18, 19): what sharding, activation checkpointing and mixed precision buy, through the CLI.

9  peak RSS of each rank of a 2-rank FSDP2 run (gloo) of a ~150M Llama built from a config, including a sharded
   checkpoint save and a restore, vs the same jobs in one process (the same micro-batch per process): FSDP2 over a
   model built on the meta device. The peak is that of the biggest process of the run (wait4 of the CLI: it waits
   for torchrun, which waits for the ranks). A second row compares the save's time.
10 peak RSS of a long-sequence run (2 x 2048 random tokens, Llama 20M) with and without
   ``distributed.activation_checkpointing``, one process.
11 tokens/s of bf16 (``distributed.mp_policy.param_dtype: bf16``: torch.autocast on the CPU) vs fp32, the two runs
   side by side (same competition), median over the steps after the warm-up. A small model (Llama 5M, 2 x 128
   tokens): on a CPU without bf16 matrix instructions a bf16 matmul is tens of times slower than fp32, and a
   bigger model's bf16 run would not finish in the run timeout.
12 the job's tokens/s of tensor parallelism (tp=2) and pipeline parallelism (pp=2, 1F1B) vs data parallelism (dp=2)
   on 2 ranks (information, no target).
"""

from __future__ import annotations

import re
import shutil
import statistics
from pathlib import Path
from typing import Any

import yaml
from harness import AUTOMODEL, CONFIGS, TOKENIZER, WORK, Job, Runner, millions, read_jsonl, run_proc, run_together
from report import Row, check, fmt
from stats import ratio


def _free_port() -> int:
    from automodel.testing import free_port

    return free_port()


def _mock_config(path: Path, model: str, seq_length: int, batch_size: int, max_steps: int) -> Path:
    """A run on random tokens (``MockDataset``) of ``seq_length``, logging every step, no checkpoints."""
    config = {
        "step_scheduler": {"max_steps": max_steps, "log_interval": 1, "num_epochs": 100},
        "rng": {"seed": 1234},
        "model": {"_target_": "automodel_llm.AutoModelForCausalLM.from_config", "config": str(CONFIGS / model)},
        "tokenizer": {"pretrained_model_name_or_path": str(TOKENIZER)},
        "dataset": {"_target_": "automodel_llm.datasets.MockDataset", "num_samples": batch_size * max_steps,
                    "seq_length": seq_length},
        "dataloader": {"batch_size": batch_size},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1.0e-4},
        "checkpoint": {"enabled": False, "checkpoint_dir": str(path.parent / "ckpt")},
        "eval_generation": {"enabled": False},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _peak(runner: Runner, name: str, cmd: list[str], timeout: float) -> dict[str, Any]:
    run_dir = WORK / "runs" / name
    proc = run_proc(cmd, run_dir / "output.log", runner.env, timeout=timeout)
    runner.note(f"{name:<24} rc={proc.rc} wall={proc.wall:5.1f}s peak rss={proc.maxrss_mib:5.0f}MiB")
    result = {"rc": proc.rc, "wall_s": proc.wall, "peak_rss_mib": proc.maxrss_mib, "cmd": proc.cmd}
    if proc.rc != 0:
        result["error"] = proc.tail()
    return result


def _save_seconds(log: Path) -> float | None:
    """The first checkpoint's duration as the engine logs it ("checkpoint: <path> (written in <s> s)")."""
    found = re.search(r"checkpoint: \S+ \(written in ([0-9.]+) s\)", log.read_text(encoding="utf-8", errors="replace"))
    return float(found.group(1)) if found else None


def section_fsdp_memory(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    """9: one process vs each of 2 FSDP2 ranks, the same micro-batch (4 samples of tiny_squad) per process.

    Each side is two commands on one checkpoint directory: train ``steps`` steps and save, then resume from that
    checkpoint (``restore_from.path latest``), train one more step and save again. A side's peak is the larger
    of its two commands' peaks, so the figure covers load, training, a sharded save and a restore."""
    steps = 2
    job = Job("fsdp_150m", model_config=CONFIGS / "llama_150m.json", batch_size=4, max_steps=steps)
    save = ["--checkpoint.enabled", "true", "--step_scheduler.checkpoint_interval", str(steps)]
    two = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2"]
    sides: dict[str, dict[str, Any]] = {}
    for side, extra in (("one", []), ("two", two)):
        run_dir = WORK / "runs" / f"fsdp-{side}"
        shutil.rmtree(run_dir, ignore_errors=True)
        port = ["--master-port", str(_free_port())] if extra else []
        first = _peak(runner, f"fsdp-{side}-save", job.engine_cmd(run_dir) + save + extra + port, 900)
        save_s = _save_seconds(WORK / "runs" / f"fsdp-{side}-save" / "output.log")
        port = ["--master-port", str(_free_port())] if extra else []
        resume = job.engine_cmd(run_dir) + save + extra + port + [
            "--restore_from.path", "latest", "--step_scheduler.max_steps", str(steps + 1)]
        second = _peak(runner, f"fsdp-{side}-restore", resume, 900)
        errors = [r["error"] for r in (first, second) if "error" in r]
        sides[side] = {"save": first, "restore": second, "save_s": save_s,
                       "peak_rss_mib": max(first["peak_rss_mib"], second["peak_rss_mib"])}
        if errors:
            sides[side]["error"] = errors[0]
    one, per_rank = sides["one"]["peak_rss_mib"], sides["two"]["peak_rss_mib"]
    error = next((s["error"] for s in sides.values() if "error" in s), None)
    r = ratio(per_rank, one) if error is None else None
    note = (f"{steps} steps + save, then restore + 1 step + save; AdamW, fp32, gloo; the biggest rank's peak "
            "over both commands")
    rows.append(Row("9", f"FSDP2 peak RSS per rank (Llama {millions('llama_150m')}, 2 ranks)", fmt(per_rank, " MiB"),
                    fmt(one, " MiB") + " 1 process", r, "<= 0.6", check(r, "<=", 0.6),
                    note if error is None else f"{note}; error: {error}"))
    one_s, two_s = sides["one"]["save_s"], sides["two"]["save_s"]
    save_ratio = ratio(two_s, one_s) if one_s and two_s else None
    rows.append(Row("9", f"sharded checkpoint save (Llama {millions('llama_150m')}, 2 ranks)", fmt(two_s, " s", 2),
                    fmt(one_s, " s", 2) + " 1 process", save_ratio, "", "info",
                    "model + AdamW state with DCP and model/ in the Hugging Face layout, each rank its share; "
                    "as the engine logs it ('written in'), the first command's"))
    return {"sides": sides, "ratio": r, "save_ratio": save_ratio}


def section_activation_memory(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    """10: the same long-sequence run with and without activation checkpointing."""
    steps = 2
    config = _mock_config(WORK / "runs" / "ac" / "config.yaml", "llama_20m.json", 2048, 2, steps)
    sides = {}
    for name, flag in (("plain", "false"), ("checkpointed", "true")):
        cmd = [AUTOMODEL, "finetune", "llm", "-c", str(config), "--distributed.activation_checkpointing", flag,
               "--checkpoint.checkpoint_dir", str(WORK / "runs" / f"ac-{name}")]
        sides[name] = _peak(runner, f"ac-{name}", cmd, 900)
        sides[name]["losses"] = [r["loss"] for r in read_jsonl(WORK / "runs" / f"ac-{name}" / "training.jsonl")]
    plain, kept = sides["plain"]["peak_rss_mib"], sides["checkpointed"]["peak_rss_mib"]
    ok = not any("error" in s for s in sides.values())
    reduction = 1 - kept / plain if ok and plain else None
    same = sides["plain"]["losses"] == sides["checkpointed"]["losses"]
    rows.append(Row("10", f"activation checkpointing peak RSS (Llama {millions('llama_20m')}, 2 x 2048 tokens)",
                    fmt(kept, " MiB"), fmt(plain, " MiB") + " without", ratio(kept, plain), "reduction >= 30%",
                    check(reduction, ">=", 0.30),
                    f"reduction {fmt(None if reduction is None else 100 * reduction, '%', 1)}; whole-process peak "
                    f"(imports included); losses equal: {same}"))
    return {"sides": sides, "reduction": reduction, "losses_equal": same}


def section_precision(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    """11: bf16 autocast vs fp32 tokens/s, one process each, run at the same time."""
    steps, warmup = (4, 1) if quick else (6, 2)
    config = _mock_config(WORK / "runs" / "precision" / "config.yaml", "llama_5m.json", 128, 2, steps)
    specs, dirs = [], {}
    for name, extra in (("fp32", []), ("bf16", ["--distributed.mp_policy.param_dtype", "bf16"])):
        dirs[name] = WORK / "runs" / f"precision-{name}"
        cmd = [AUTOMODEL, "finetune", "llm", "-c", str(config), "--checkpoint.checkpoint_dir", str(dirs[name]),
               *extra]
        specs.append((cmd, dirs[name] / "output.log", dirs[name] / "training.jsonl"))
    procs = run_together(specs, runner.env, runner.args.run_timeout)
    sides = {}
    for (name, run_dir), proc in zip(dirs.items(), procs, strict=True):
        steps_logged = read_jsonl(run_dir / "training.jsonl")
        tps = [r["tps"] for r in steps_logged[warmup:]]
        sides[name] = {"rc": proc.rc, "wall_s": proc.wall, "tokens_per_s": statistics.median(tps) if tps else None,
                       "losses": [r["loss"] for r in steps_logged]}
        runner.note(f"precision {name:<5} rc={proc.rc} tokens/s={sides[name]['tokens_per_s']}")
    fp32, bf16 = sides["fp32"]["tokens_per_s"], sides["bf16"]["tokens_per_s"]
    rows.append(Row("11", f"bf16 (autocast) vs fp32 tokens/s (Llama {millions('llama_5m')}, CPU)",
                    fmt(bf16, " tok/s"), fmt(fp32, " tok/s") + " fp32", ratio(bf16, fp32), "", "info",
                    f"median over steps {warmup + 1}-{steps}, both runs at once; a CPU without bf16 matrix units "
                    "(AMX / AVX512-BF16) gains nothing from bf16"))
    return {"sides": sides}


def section_model_parallel(runner: Runner, rows: list[Row], quick: bool) -> dict[str, Any]:
    """12: the job's tokens/s under tensor parallelism (tp=2) and pipeline parallelism (pp=2) vs data parallelism
    (FSDP2, dp=2), 2 ranks each, one run after the other. Rank 0 logs its own tokens/s: the two tensor-parallel (or
    pipeline) ranks read the same tokens, so that is the job's; under dp=2 each rank reads its own half, so the
    job's is twice it. Pipeline stages cannot share a tied embedding, so every layout runs the model untied."""
    steps, warmup = (4, 1) if quick else (6, 2)
    config = _mock_config(WORK / "runs" / "model_parallel" / "config.yaml", "llama_5m.json", 128, 4, steps)
    layouts = {"tp2": (["--distributed.tp_size", "2"], 1), "pp2": (["--distributed.pp_size", "2"], 1), "dp2": ([], 2)}
    sides = {}
    for name, (extra, dp) in layouts.items():
        run_dir = WORK / "runs" / f"model-parallel-{name}"
        cmd = [AUTOMODEL, "finetune", "llm", "-c", str(config), "--checkpoint.checkpoint_dir", str(run_dir),
               "--nproc-per-node", "2", "--distributed.strategy", "fsdp2", "--model.tie_word_embeddings", "false",
               "--master-port", str(_free_port()), *extra]
        proc = run_proc(cmd, run_dir / "output.log", runner.env, timeout=runner.args.run_timeout)
        logged = read_jsonl(run_dir / "training.jsonl") if proc.rc == 0 else []
        tps = [r["tps"] * dp for r in logged[warmup:]]
        sides[name] = {"rc": proc.rc, "wall_s": proc.wall, "tokens_per_s": statistics.median(tps) if tps else None,
                       "losses": [r["loss"] for r in logged]}
        if proc.rc != 0:
            sides[name]["error"] = proc.tail()
        runner.note(f"model parallel {name} rc={proc.rc} job tokens/s={sides[name]['tokens_per_s']}")
    tp2, dp2 = sides["tp2"]["tokens_per_s"], sides["dp2"]["tokens_per_s"]
    rows.append(Row("12", f"tp=2 vs dp=2 job tokens/s (Llama {millions('llama_5m')}, 2 ranks, CPU)",
                    fmt(tp2, " tok/s"), fmt(dp2, " tok/s") + " dp=2", ratio(tp2, dp2), "", "info",
                    f"median over steps {warmup + 1}-{steps}, 4 x 128 random tokens per rank and step, gloo; tensor "
                    "parallelism pays collectives in every layer for memory, data parallelism only per step"))
    pp2 = sides["pp2"]["tokens_per_s"]
    rows.append(Row("12", f"pp=2 (1F1B) vs dp=2 job tokens/s (Llama {millions('llama_5m')}, 2 ranks, CPU)",
                    fmt(pp2, " tok/s"), fmt(dp2, " tok/s") + " dp=2", ratio(pp2, dp2), "", "info",
                    f"median over steps {warmup + 1}-{steps}, 4 micro-batches of 1 x 128 tokens per step, gloo; "
                    "each stage holds half the layers, and idles while the pipeline fills and drains"))
    return {"sides": sides}
