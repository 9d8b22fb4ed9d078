"""The bench's harness: where its files live, running the sides of a comparison as subprocesses (wall, CPU and
peak RSS of exactly each child), the training job as the CLI and the baselines spell it, and the asset snapshot."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata, util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PY = sys.executable
AUTOMODEL = str(Path(PY).parent / "automodel")
LLM_PKG = Path(util.find_spec("automodel_llm").submodule_search_locations[0])  # found, not imported
ASSETS = LLM_PKG / "examples" / "assets"
WORK = Path(tempfile.gettempdir()) / f"automodel-bench-{os.getuid()}"  # persistent: datasets caches stay warm
# Every run reads a snapshot of the shipped assets taken at start (snapshot_assets), so that all sides of a
# comparison see the same files even while the package's assets are being regenerated.
SNAPSHOT = WORK / "assets"
TINY_CONFIG = SNAPSHOT / "tiny_llama" / "config.json"
TOKENIZER = SNAPSHOT / "tiny_tokenizer"
TINY_SQUAD = SNAPSHOT / "tiny_squad"
CONFIGS = SNAPSHOT / "configs"  # bench/configs/*.json with the tiny tokenizer's vocabulary filled in
TEMPLATES = BENCH / "configs"
BATCH = 32  # the tiny default's dataloader.batch_size
ASSET_INFO: dict[str, Any] = {}  # filled by snapshot_assets() at start


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a run wrote so far ([] before its file exists)."""
    from automodel.testing import read_jsonl as read

    return read(path) if path.is_file() else []


# ---- processes -----------------------------------------------------------------------------------------------

@dataclass
class Proc:
    cmd: list[str]
    t0: float  # time.time() just before the process was started
    wall: float
    rc: int
    maxrss_mib: float
    log: str  # path of its combined stdout/stderr
    cpu_samples: list = field(default_factory=list)  # (lines in the watched file, time.time(), child CPU s)
    cpu_total: float | None = None

    def tail(self, n: int = 15) -> str:
        try:
            lines = Path(self.log).read_text(encoding="utf-8", errors="replace").replace("\r", "\n").splitlines()
        except OSError:
            return ""
        return "\n".join(line for line in lines[-n:] if line.strip())


def child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
               TOKENIZERS_PARALLELISM="false")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def cpu_seconds(pid: int) -> float | None:
    """On-CPU time of the process's live threads (ns resolution, /proc/<pid>/task/*/schedstat)."""
    total = 0
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                with open(f"{task.path}/schedstat", "rb") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        return None
    return total / 1e9


def run_proc(cmd: list[str], log: Path, env: dict[str, str], cwd: Path = WORK, timeout: float = 300) -> Proc:
    """Run to completion; wall time and peak RSS of exactly this child (wait4), not of the bench."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        t0 = time.time()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - start
    rc = os.waitstatus_to_exitcode(status)
    proc.returncode = rc  # reaped by wait4 above
    return Proc([str(c) for c in cmd], t0, wall, rc, usage.ru_maxrss / 1024, str(log),
                cpu_total=usage.ru_utime + usage.ru_stime)


def run_together(specs: list[tuple[list[str], Path, Path]], env: dict[str, str], timeout: float = 300,
                 cwd: Path = WORK) -> list[Proc]:
    """Start several (cmd, log, watched JSONL) at once and wait for all of them.

    Each child's CPU time is sampled whenever its JSONL (one line per optimizer step) grows; the files are
    polled every 2 ms, so a step window's CPU seconds can be told apart from the wall seconds that other
    processes on a shared machine stretch.
    """
    children = []
    for cmd, log, watch in specs:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "wb")  # noqa: SIM115 - closed below
        t0, start = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd)
        children.append({"cmd": cmd, "log": log, "watch": watch, "out": out, "proc": proc, "t0": t0,
                         "start": start, "size": 0, "samples": [], "done": None})
    deadline = time.perf_counter() + timeout
    while any(c["done"] is None for c in children):
        for c in children:
            if c["done"] is not None:
                continue
            pid, status, usage = os.wait4(c["proc"].pid, os.WNOHANG)
            if pid:
                c["done"] = (status, usage, time.perf_counter() - c["start"])
                continue
            try:
                size = os.stat(c["watch"]).st_size
            except OSError:
                size = c["size"]
            if size != c["size"]:
                cpu = cpu_seconds(c["proc"].pid)
                with open(c["watch"], "rb") as f:
                    lines = f.read().count(b"\n")
                c["size"] = size
                c["samples"].append((lines, time.time(), cpu))
        if time.perf_counter() > deadline:
            for c in children:
                if c["done"] is None:
                    c["proc"].kill()
        time.sleep(0.002)
    results = []
    for c in children:
        c["out"].close()
        status, usage, wall = c["done"]
        rc = os.waitstatus_to_exitcode(status)
        c["proc"].returncode = rc
        results.append(Proc([str(x) for x in c["cmd"]], c["t0"], wall, rc, usage.ru_maxrss / 1024, str(c["log"]),
                            c["samples"], usage.ru_utime + usage.ru_stime))
    return results


# ---- the training job, as the CLI and the baselines each spell it ------------------------------------------

@dataclass
class Job:
    name: str
    model_config: Path = TINY_CONFIG
    data: Path = TINY_SQUAD
    max_seq_length: int = 64
    truncation: bool = False
    batch_size: int = BATCH
    max_steps: int | None = 75
    num_epochs: int = 100
    warmup: int = 25  # steps excluded from tokens/s
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)  # set on every side (the example config's own are these too)
    warmup_steps: int = 20
    min_lr: float = 1e-4
    max_norm: float = 1.0
    seed: int = 1234
    engine_extra: list[str] = field(default_factory=list)

    def engine_cmd(self, run_dir: Path) -> list[str]:
        def b(value: bool) -> str:
            return "true" if value else "false"

        return [AUTOMODEL, "finetune", "llm", "-c", "llm/tiny_squad",
                "--checkpoint.checkpoint_dir", str(run_dir), "--checkpoint.enabled", "false",
                "--eval_generation.enabled", "false",
                "--step_scheduler.max_steps", "null" if self.max_steps is None else str(self.max_steps),
                "--step_scheduler.num_epochs", str(self.num_epochs),
                "--step_scheduler.log_interval", "1", "--step_scheduler.val_check_interval", "null",
                "--step_scheduler.grad_accumulation_steps", "1",
                "--model.config", str(self.model_config),
                "--tokenizer.pretrained_model_name_or_path", str(TOKENIZER),
                "--dataset.dataset_name", str(self.data), "--dataset.max_seq_length", str(self.max_seq_length),
                "--dataset.truncation", b(self.truncation),
                "--validation_dataset.dataset_name", str(TINY_SQUAD),
                "--dataloader.batch_size", str(self.batch_size),
                "--optimizer.lr", repr(self.lr), "--optimizer.weight_decay", repr(self.weight_decay),
                "--optimizer.betas", f"[{self.betas[0]!r}, {self.betas[1]!r}]",
                "--lr_scheduler.warmup_steps", str(self.warmup_steps), "--lr_scheduler.min_lr", repr(self.min_lr),
                "--clip_grad_norm.max_norm", repr(self.max_norm), "--rng.seed", str(self.seed),
                *self.engine_extra]

    def baseline_cmd(self, script: str, out: Path) -> list[str]:
        assert self.max_steps is not None, "baselines run a fixed number of steps"
        cmd = [PY, str(BENCH / "baselines" / script), "--model-config", str(self.model_config),
               "--tokenizer", str(TOKENIZER), "--data", str(self.data), "--val-data", str(TINY_SQUAD),
               "--max-seq-length", str(self.max_seq_length), "--batch-size", str(self.batch_size),
               "--max-steps", str(self.max_steps), "--lr", repr(self.lr), "--weight-decay", repr(self.weight_decay),
               "--betas", repr(self.betas[0]), repr(self.betas[1]),
               "--warmup-steps", str(self.warmup_steps), "--min-lr", repr(self.min_lr),
               "--max-norm", repr(self.max_norm), "--seed", str(self.seed), "--out", str(out)]
        return cmd + (["--truncation"] if self.truncation else [])


@dataclass
class Side:
    """One side of a comparison: who runs (automodel CLI / hand loop / HF Trainer) which job."""
    name: str  # how results are keyed
    kind: str  # automodel | hand | trainer
    job: Job


class Runner:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.env = child_env(args.threads)
        self.counter = 0
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def note(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", file=sys.stderr, flush=True)

    def run(self, sides: list[Side]) -> dict[str, dict[str, Any]]:
        """Run the sides *at the same time* (concurrent mode, the default) or one after the other (--sequential).

        Side by side at the same moment, every side meets the same competition from whatever else the machine
        runs; one after another, a busy minute lands on one side only (on the shared 2-core machine this bench
        was written on that swung single runs by 2x)."""
        specs = []
        for side in sides:
            self.counter += 1
            run_dir = WORK / "runs" / f"{self.counter:03d}-{side.job.name}-{side.name}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            if side.kind == "automodel":
                cmd, out = side.job.engine_cmd(run_dir), run_dir / "training.jsonl"
            else:
                out = run_dir / "steps.jsonl"
                cmd = side.job.baseline_cmd({"hand": "hand_loop.py", "trainer": "hf_trainer.py"}[side.kind], out)
            specs.append((side, run_dir, cmd, out))
        if self.args.sequential:
            procs = [run_together([(cmd, d / "output.log", out)], self.env, self.args.run_timeout)[0]
                     for _, d, cmd, out in specs]
        else:
            procs = run_together([(cmd, d / "output.log", out) for _, d, cmd, out in specs], self.env,
                                 self.args.run_timeout)
        results = {}
        for (side, run_dir, _, out), proc in zip(specs, procs, strict=False):
            rows = read_jsonl(out)
            cpu_at: dict[int, float] = {}  # step -> child CPU s when the bench first saw that step's line
            for lines, _, cpu in proc.cpu_samples:
                if cpu is not None and 0 < lines <= len(rows):
                    cpu_at.setdefault(rows[lines - 1]["step"], cpu)
            result: dict[str, Any] = {"side": side.name, "kind": side.kind, "job": side.job.name, "rc": proc.rc,
                                      "wall_s": proc.wall, "peak_rss_mib": proc.maxrss_mib, "t0": proc.t0,
                                      "cmd": proc.cmd, "steps": rows, "cpu_at_step": cpu_at,
                                      "cpu_total_s": proc.cpu_total}
            if proc.rc != 0 or not rows:
                result["error"] = f"exit {proc.rc}: " + proc.tail()
            else:
                result["time_to_first_step_s"] = rows[0]["timestamp"] - proc.t0
            self.note(f"{side.job.name:<14} {side.name:<9} rc={proc.rc} wall={proc.wall:5.1f}s "
                      f"rss={proc.maxrss_mib:5.0f}MiB steps={len(rows)}")
            if not self.args.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
            results[side.name] = result
        return results


# ---- assets and the machine --------------------------------------------------------------------------------------

def snapshot_assets() -> dict[str, Any]:
    """Copy the shipped tiny assets (only files that changed: the datasets cache stays valid) and write the
    bench's bigger Llama configs with the tiny tokenizer's vocabulary and special-token ids."""
    for name in ("tiny_llama", "tiny_tokenizer", "tiny_squad"):
        src, dst = ASSETS / name, SNAPSHOT / name
        dst.mkdir(parents=True, exist_ok=True)
        for file in src.iterdir():
            if file.is_file():
                target = dst / file.name
                if not target.is_file() or target.read_bytes() != file.read_bytes():
                    shutil.copy2(file, target)
    tiny = json.loads(TINY_CONFIG.read_text(encoding="utf-8"))
    CONFIGS.mkdir(parents=True, exist_ok=True)
    params = {}
    for template in sorted(TEMPLATES.glob("*.json")):
        config = json.loads(template.read_text(encoding="utf-8"))
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
            config[key] = tiny[key]
        text = json.dumps(config, indent=2) + "\n"
        target = CONFIGS / template.name
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
        params[template.stem] = llama_params(config)
    samples = sum(1 for line in (TINY_SQUAD / "train.jsonl").read_text(encoding="utf-8").splitlines() if line.strip())
    return {"tiny_squad_train_samples": samples, "tiny_epoch_steps": -(-samples // BATCH),
            "params": {"tiny_llama": llama_params(tiny), **params}, "vocab_size": tiny["vocab_size"]}


def millions(name: str) -> str:
    return f"{ASSET_INFO['params'][name] / 1e6:.1f}M"


def llama_params(c: dict[str, Any]) -> int:
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * c.get("head_dim", h // c["num_attention_heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return n * layer + v * h * (1 if c.get("tie_word_embeddings") else 2) + h


def machine_info(threads: int | None) -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"cpu": cpu, "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "threads_per_run": threads, "load_average_start": os.getloadavg(), "platform": platform.platform(),
            "python": platform.python_version(),
            "versions": {d: version(d) for d in ("torch", "transformers", "accelerate", "datasets", "torchdata",
                                                 "safetensors", "tokenizers", "automodel-core", "automodel-llm")},
            "env": {k: os.environ.get(k) for k in ("PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS")}}
