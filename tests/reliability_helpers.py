"""Helpers for the reliability tests (tests/test_reliability_*.py), and a fault-injecting model target.

Test modules import it by name (pytest.ini puts this directory on ``sys.path``); the helpers every distribution
shares (reading metric files, writing configs and plugin distributions, in-process runs) are ``automodel.testing``.

The same module is also a *target package* for configs: with this directory on ``PYTHONPATH`` and
``AUTOMODEL_ALLOW_TARGETS=reliability_helpers`` a config may say
``model: {_target_: reliability_helpers.faulty_model, config: ...}``. That builds the ordinary tiny Llama (the
same weights as ``automodel_llm.AutoModelForCausalLM.from_config``) and, when asked, injects faults:

* ``nan_at_steps=[3]``: the logits of training step 3 are multiplied by NaN (a realistic non-finite loss);
* ``AMT_FAULT_SLEEP=0.3``: every training step sleeps that long (so a signal lands mid-run);
* ``AMT_FAULT_PAUSE=<point>:<n>`` with ``AMT_FAULT_MARKER=<file>``: at the n-th occurrence of the point the
  process writes the marker file and waits until ``<marker>.go`` exists (or forever: the test kills it).
  Points: ``step`` (inside the forward of training step n), ``write`` (the n-th checkpoint's shards are in its
  staging directory, its model/ is not exported from them yet), ``latest`` (the n-th checkpoint has been renamed
  into place but LATEST has not been replaced yet), ``exchange`` (the n-th re-save of an existing step is
  complete beside it, about to be swapped in), ``retention`` (keep_last is deleting its n-th old checkpoint and
  has removed part of it).

Environment variables (not config keys) carry the pauses, so a crashed run and its resume use the same config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from automodel import testing
from automodel.testing import OFFLINE

for _name, _value in OFFLINE.items():
    os.environ.setdefault(_name, _value)

HERE = Path(__file__).resolve().parent
BAD_CONFIGS = HERE / "bad_configs"
ALLOW = "reliability_helpers"
AUTOMODEL_BIN = Path(sys.executable).with_name("automodel")


def llm_assets() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("automodel_llm")
    return Path(list(spec.submodule_search_locations)[0]) / "examples" / "assets"


# A 1-layer, 32-wide Llama with the shipped tokenizer's vocabulary: a step takes milliseconds on a CPU.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "tie_word_embeddings": True,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}


def write_tiny_llama(directory: Path, **overrides: Any) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **overrides}, indent=2))
    return path


def run_config(model_config: Path, checkpoint_dir: str | Path = "ckpt", *, faulty: bool = False,
               **sections: Any) -> dict[str, Any]:
    """A tiny ``finetune llm`` config: 16 samples, batch 4, no validation; ``sections`` are merged in."""
    assets = llm_assets()
    data: dict[str, Any] = {
        "step_scheduler": {"max_steps": 6, "grad_accumulation_steps": 1, "log_interval": 1, "num_epochs": 100,
                           "checkpoint_interval": 2},
        "rng": {"seed": 1234},
        "model": {"_target_": f"{ALLOW}.faulty_model" if faulty else "automodel_llm.AutoModelForCausalLM.from_config",
                  "config": str(model_config)},
        "tokenizer": {"pretrained_model_name_or_path": str(assets / "tiny_tokenizer")},
        "dataset": {"_target_": "automodel_llm.datasets.SquadDataset", "dataset_name": str(assets / "tiny_squad"),
                    "split": "train", "max_seq_length": 64, "limit_dataset_samples": 16},
        "dataloader": {"batch_size": 4},
        "clip_grad_norm": {"max_norm": 1.0},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 3.0e-3, "weight_decay": 0.01},
        "checkpoint": {"checkpoint_dir": str(checkpoint_dir)},
        "eval_generation": {"enabled": False},
    }
    for name, value in sections.items():
        if value is None:
            data.pop(name, None)
        elif isinstance(value, dict) and isinstance(data.get(name), dict):
            data[name] = {**data[name], **value}
        else:
            data[name] = value
    return data


def assert_complete_checkpoint(path: Path) -> None:
    """What a resume needs is all there and readable without unpickling: weights, optimizer shards, RNG, data
    position, counters, config."""
    from safetensors.torch import load_file

    from automodel.training.parallel.shard_files import read_slices
    from automodel.training.state_files import read_state

    path = Path(path)
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["step"] == int(path.name.rsplit("_", 1)[1]), (path, state)
    assert (path / "config.yaml").is_file()
    weights = sorted((path / "model").glob("*.safetensors"))
    assert weights, f"{path}: no weights"
    for file in weights:
        load_file(str(file))
    read_slices(path / "optim")
    for sub in ("rng", "dataloader"):
        files = sorted((path / sub).glob("rank_*.json"))
        assert files, f"{path}/{sub}: empty"
        for file in files:
            read_state(file.with_suffix(""))


def assert_latest_is_complete(root: Path) -> str | None:
    """LATEST, when present, names a complete checkpoint; returns that name."""
    marker = Path(root) / "LATEST"
    if not marker.exists():
        return None
    name = marker.read_text().strip()
    assert name.startswith("epoch_"), name
    assert_complete_checkpoint(Path(root) / name)
    return name


def inprocess_env():
    """(A module fixture: ``pytest.fixture(scope="module", name="inprocess")(inprocess_env)``.)

    In-process runs of a module: this directory's targets allowed, and one thread, as the child processes
    (OMP_NUM_THREADS=1) have, so in-process and subprocess runs do the same arithmetic."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOMODEL_ALLOW_TARGETS", ALLOW)
        mp.syspath_prepend(str(HERE))
        yield
    torch.set_num_threads(threads)


# ---- running the CLI ---------------------------------------------------------------------------------------

def cli_env(**extra: str) -> dict[str, str]:
    """automodel.testing's CLI environment with this directory's targets allowed and no inherited fault settings."""
    env = testing.cli_env(**{"PYTHONPATH": str(HERE), "AUTOMODEL_ALLOW_TARGETS": ALLOW, "PYTHONUNBUFFERED": "1",
                             **extra})
    return {k: v for k, v in env.items() if not k.startswith("AMT_FAULT_") or k in extra}


def cli_command(*args: Any) -> list[str]:
    exe = [str(AUTOMODEL_BIN)] if AUTOMODEL_BIN.exists() else [sys.executable, "-m", "automodel.cli.main"]
    return [*exe, *map(str, args)]


def start_cli(*args: Any, cwd: Path, log: Path, piped: bool = False, new_session: bool = False,
              **env: str) -> subprocess.Popen:
    """Start ``automodel <args>`` with stdout+stderr going to ``log`` (read it while it runs). ``piped``: through a
    pipe this process copies into ``log`` (so a file-size limit put on the child does not bind its output).
    ``new_session``: in a process group of its own (its id the child's pid), to signal it whole as a scheduler
    does."""
    out = open(log, "w")  # noqa: SIM115 - the child holds it; closed by the caller's finish()
    proc = subprocess.Popen(cli_command(*args), cwd=cwd, env=cli_env(**env), stdout=subprocess.PIPE if piped else out,
                            stderr=subprocess.STDOUT, text=True, start_new_session=new_session)
    if piped:
        def copy() -> None:
            for line in proc.stdout:
                out.write(line)
                out.flush()

        proc.copier = threading.Thread(target=copy, daemon=True)  # type: ignore[attr-defined]
        proc.copier.start()  # type: ignore[attr-defined]
    proc.log_file = out  # type: ignore[attr-defined]
    proc.log_path = Path(log)  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if hasattr(proc, "copier"):
            proc.copier.join(timeout=30)
        proc.log_file.close()  # type: ignore[attr-defined]
    return rc, proc.log_path.read_text()  # type: ignore[attr-defined]


def wait_for(predicate, proc: subprocess.Popen | None = None, timeout: float = 240, what: str = "") -> None:
    """Poll until ``predicate()``; fail early (with the child's log) if the child exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            log = proc.log_path.read_text() if hasattr(proc, "log_path") else ""
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{log[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def jsonl_lines(path: Path) -> int:
    try:
        return sum(1 for line in Path(path).read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


# ---- the fault-injecting model target ----------------------------------------------------------------------

def _pause_spec() -> tuple[str | None, int, Path | None]:
    spec = os.environ.get("AMT_FAULT_PAUSE", "")
    marker = os.environ.get("AMT_FAULT_MARKER")
    if not spec or not marker:
        return None, 0, None
    point, _, count = spec.partition(":")
    return point, int(count or 1), Path(marker)


def _pause(marker: Path) -> None:
    """Tell the test we are here, then wait for it: it kills us, or creates ``<marker>.go``."""
    marker.write_text(str(os.getpid()))
    go = marker.with_name(marker.name + ".go")
    deadline = time.monotonic() + 300
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


class _Counter:
    def __init__(self, point: str | None, count: int, marker: Path | None):
        self.point, self.count, self.marker, self.seen = point, count, marker, {}

    def hit(self, point: str) -> None:
        self.seen[point] = self.seen.get(point, 0) + 1
        if point == self.point and self.seen[point] == self.count and self.marker is not None:
            _pause(self.marker)


def _install_checkpoint_pauses(counter: _Counter) -> None:
    import shutil as real_shutil

    from automodel.training import checkpoint, checkpoint_write

    def pause_before(module, name, point, when=lambda *args: True):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            if when(*args):
                counter.hit(point)
            return real(*args, **kwargs)

        setattr(module, name, wrapper)

    if counter.point == "write":  # shards written, model/ not yet exported from them
        pause_before(checkpoint_write, "export_hf", "write")
    if counter.point == "latest":  # renamed into place, LATEST not yet replaced
        pause_before(checkpoint, "write_atomic", "latest", lambda path, text: Path(path).name == checkpoint.LATEST)
    if counter.point == "exchange":  # re-saving a step: the new copy complete, about to swap it in
        pause_before(checkpoint, "exchange", "exchange")
    if counter.point == "retention":
        class _Shutil:
            def __getattr__(self, name):
                return getattr(real_shutil, name)

            @staticmethod
            def rmtree(path, *args, **kwargs):
                path = Path(path)
                if "delete-" in path.name and (path / "model").is_dir():
                    real_shutil.rmtree(path / "model")  # part of it is gone, the rest is not
                    counter.hit("retention")
                return real_shutil.rmtree(path, *args, **kwargs)

        checkpoint.shutil = _Shutil()


def faulty_model(config: Any, nan_at_steps: list[int] | None = None, seed: int | None = None, **kwargs: Any) -> Any:
    """The tiny Llama of ``config`` (as ``AutoModelForCausalLM.from_config``), with the faults described above."""
    import torch

    from automodel_llm import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, seed=seed, **kwargs)
    nan_steps = set(nan_at_steps or ())
    sleep = float(os.environ.get("AMT_FAULT_SLEEP", "0") or 0)
    counter = _Counter(*_pause_spec())
    state = {"step": 0}

    def pre_hook(module, args, kw):
        if module.training and torch.is_grad_enabled():  # a training micro-batch (grad accumulation 1: a step)
            state["step"] += 1
            if sleep:
                time.sleep(sleep)
            counter.hit("step")

    def post_hook(module, args, kw, output):
        if module.training and torch.is_grad_enabled() and state["step"] in nan_steps:
            output.logits = output.logits * float("nan")
        return output

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True)
    _install_checkpoint_pauses(counter)
    return model


