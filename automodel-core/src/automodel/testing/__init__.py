"""Test helpers for every distribution's tests and for plugin authors.

Reading what a run wrote (``read_jsonl``, ``checkpoint_dirs``, ``load_safetensors_state``), writing configs and
plugin distributions (``deep_update``, ``write_yaml``, ``write_dist``), running a recipe in this process as the CLI
does (``train_inprocess``), the installed console script in a subprocess (``run_cli``) or its entry point in this
process (``run_cli_inprocess``), a session fixture's result shared by pytest-xdist workers (``once_per_session``).
The toy recipe (``automodel.testing.toy``: a tiny torch model on synthetic data that exercises the engine in
milliseconds, without any Hugging Face library) is importable from here too. Importing this package imports no
torch.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
AUTOMODEL_BIN = Path(sys.executable).with_name("automodel")


# ---- what a run wrote --------------------------------------------------------------------------------------------

def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def losses_by_step(path: str | Path) -> dict[int, float]:
    """Step -> loss from training.jsonl (a resumed run appends; the last line of a step wins)."""
    return {r["step"]: r["loss"] for r in read_jsonl(path)}


def checkpoint_dirs(root: str | Path) -> list[str]:
    """The checkpoint directory names under ``root`` (``epoch_E_step_S``), in step order."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("epoch_")),
                  key=lambda n: int(n.rsplit("_", 1)[1]))


def load_safetensors_state(directory: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def assert_states_equal(a: dict[str, Any], b: dict[str, Any], atol: float = 0.0) -> None:
    """Same keys and shapes; values bitwise equal (``atol=0``) or within ``atol``."""
    import torch

    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for key in a:
        x, y = a[key].detach().cpu(), b[key].detach().cpu()
        assert x.shape == y.shape, key
        if atol == 0.0:
            assert torch.equal(x, y), f"{key}: max |diff| {float((x.float() - y.float()).abs().max())}"
        else:
            assert torch.allclose(x, y, atol=atol, rtol=0), f"{key}: max |diff| {float((x - y).abs().max())}"


# ---- writing configs and distributions ---------------------------------------------------------------------------

def deep_update(base: dict, extra: dict) -> dict:
    """``extra`` merged into a copy of ``base``; a value of None removes the key."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_update(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def write_yaml(path: str | Path, data: dict[str, Any]) -> Path:
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return Path(path)


def write_dist(root: str | Path, dist: str, version: str, entry_points: str | dict[str, str],
               files: dict[str, str]) -> Path:
    """A plugin distribution as ``pip install`` leaves it (package files and a real ``.dist-info``); putting
    ``root`` on ``sys.path`` / ``PYTHONPATH`` makes ``importlib.metadata`` find its ``automodel`` entry points."""
    root = Path(root)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if isinstance(entry_points, dict):
        entry_points = "[automodel]\n" + "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)
    return root


# ---- running -----------------------------------------------------------------------------------------------------

def load_config(config: str | Path, *overrides: Any, route: tuple[str, str] = ("finetune", "llm"),
                recipe: type | None = None) -> tuple[type, Any]:
    """Validate a config as the CLI does, for a route's recipe (or ``recipe``); returns (recipe class, config)."""
    from automodel.cli.execute import import_recipe, load_and_validate
    from automodel.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    recipe_cls = recipe or import_recipe(manager.routes.get(*route).recipe)
    return recipe_cls, load_and_validate(recipe_cls, Path(config), [str(o) for o in overrides], manager)


def train_inprocess(config: str | Path, *overrides: Any, route: tuple[str, str] = ("finetune", "llm"),
                    recipe: type | None = None, before_run: Any = None, setup_only: bool = False) -> Any:
    """Validate, set up and run a recipe in this process as the CLI does; returns the recipe afterwards.

    ``before_run(recipe)`` is called between setup and the loop; ``setup_only`` stops after setup.
    """
    recipe_cls, cfg = load_config(config, *overrides, route=route, recipe=recipe)
    run = recipe_cls(cfg)
    run.setup()
    if setup_only:
        return run
    if before_run is not None:
        before_run(run)
    run.run_train_validation_loop()
    return run


def once_per_session(tmp_path_factory: Any, name: str, compute: Any) -> Any:
    """``compute(directory)`` run once in a whole pytest session, for a session fixture: its JSON-able result
    (``Path`` values kept) is shared by every pytest-xdist worker through the session's base temp directory, the
    first worker to need it computing it under a file lock while the others wait and then read it. (A session
    fixture is otherwise computed again on every worker that runs a file using it, and a multi-process fixture run
    twice at once also slows the first one down on shared cores.)"""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    saved = root / f"{name}.json"
    with FileLock(str(saved) + ".lock"):
        if not saved.is_file():
            directory = root / name
            directory.mkdir(exist_ok=True)
            saved.write_text(json.dumps(compute(directory), default=_encode_path))
        return json.loads(saved.read_text(), object_hook=_decode_path)


def _encode_path(value: Any) -> Any:
    if isinstance(value, Path):
        return {"__path__": str(value)}
    raise TypeError(f"once_per_session: {type(value).__name__} is not JSON-able")


def _decode_path(value: dict[str, Any]) -> Any:
    return Path(value["__path__"]) if set(value) == {"__path__"} else value


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port nothing listens on now, for a rendezvous of its own, never one this process handed out before.

    The port comes from below Linux's ephemeral range (32768 and up), so no outgoing connection of another test can
    take it between this call and the launch, and from a band of its own per pytest-xdist worker, so two workers
    never pick the same one. (Binding port 0 and closing it, the usual trick, hands the same port to two launches
    started back to back, and the kernel gives such ports to outgoing connections too.)"""
    import random
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    band = 20_000 + 1_000 * (int(worker) % 12 if worker.isdigit() else 0)
    for port in random.sample(range(band, band + 1_000), 1_000):
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free TCP port left in {band}-{band + 999}")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess: offline, no AUTOMODEL_* settings of the caller, ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOMODEL_")}
    env.update(OFFLINE)
    env.update(extra)
    return env


def run_cli(*args: Any, cwd: str | Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``automodel <args>`` through the installed console script in a subprocess (text output captured)."""
    command = [str(AUTOMODEL_BIN)] if AUTOMODEL_BIN.exists() else [sys.executable, "-m", "automodel.cli.main"]
    return subprocess.run([*command, *map(str, args)], cwd=cwd, env=cli_env(**env), capture_output=True,
                          text=True, timeout=timeout, check=False)


def run_cli_inprocess(*args: Any, cwd: str | Path, **env: str) -> subprocess.CompletedProcess:
    """``automodel <args>`` through the console script's entry point (``automodel.cli.main.main``) in this process:
    the same parsing, error reporting and exit code as ``run_cli``, without a new interpreter importing torch and
    transformers each time (seconds per call). For commands that only check, such as ``validate``; a run stays a
    subprocess. The environment is ``cli_env(**env)`` and the working directory ``cwd`` for the call, both restored
    after; an exception that escapes the entry point is printed to the captured stderr with exit code 1, as the
    console script would.
    """
    import contextlib
    import io
    import traceback

    from automodel.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(cli_env(**env))
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["automodel", *map(str, args)], code, out.getvalue(), err.getvalue())


_TOY = ("ToyDataset", "ToyModel", "ToyPlugin", "ToyRecipe", "toy_config")


def __getattr__(name: str) -> Any:
    if name in _TOY:  # the toy recipe imports torch: loaded on first use
        from automodel.testing import toy

        return getattr(toy, name)
    raise AttributeError(f"module 'automodel.testing' has no attribute '{name}'")
