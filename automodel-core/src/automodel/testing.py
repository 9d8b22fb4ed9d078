"""Test helpers for every distribution's tests and for plugin authors.

Reading what a run wrote (``read_jsonl``, ``checkpoint_dirs``, ``load_safetensors_state``), writing configs and
plugin distributions (``deep_update``, ``write_yaml``, ``write_dist``), running a recipe in this process as the CLI
does (``train_inprocess``) or the installed console script in a subprocess (``run_cli``), and a toy recipe — a
tiny torch model on synthetic data, registered by ``ToyPlugin`` as ``automodel train toy`` — that exercises the
engine in milliseconds without any Hugging Face library.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from automodel.plugins.markers import hookimpl
from automodel.training.recipe import TrainRecipe

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


def load_safetensors_state(directory: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    """Same keys and shapes; values bitwise equal (``atol=0``) or within ``atol``."""
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


# ---- the toy recipe ----------------------------------------------------------------------------------------------

class ToyDataset(torch.utils.data.Dataset):
    """Synthetic regression rows: ``x`` [targets, dim] -> ``y`` [targets]; ``mask`` keeps 1..targets of them, so
    samples carry different numbers of targets (like answers of different lengths)."""

    def __init__(self, size: int = 64, dim: int = 8, targets: int = 4, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, targets, dim, generator=generator)
        weights = torch.randn(dim, generator=generator)
        self.y = torch.tanh(self.x @ weights) + 0.1 * torch.randn(size, targets, generator=generator)
        lengths = torch.randint(1, targets + 1, (size,), generator=generator)
        self.mask = (torch.arange(targets) < lengths[:, None]).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index], "mask": self.mask[index]}


class ToyModel(torch.nn.Module):
    """A small MLP with a ModuleList of identical blocks (what FSDP2 shards block by block)."""

    def __init__(self, dim: int = 8, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Linear(dim, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h).squeeze(-1)


class ToyRecipe(TrainRecipe):
    """Squared error summed over the masked targets of a ToyDataset; a target counts as a label token."""

    domain = "toy"

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((model(batch["x"]) - batch["y"]) ** 2 * batch["mask"]).sum()

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["mask"].sum())


class ToyPlugin:
    """Registers ``automodel train toy`` (pass it to ``PluginManager(extra_plugins=[("toy", ToyPlugin)])``)."""

    @staticmethod
    @hookimpl
    def automodel_register_routes(routes: Any) -> None:
        routes.add("train", "toy", recipe="automodel.testing.ToyRecipe", help="The engine on a toy model")

    @staticmethod
    @hookimpl
    def automodel_allowed_targets() -> list[str]:
        return ["automodel.testing"]


def toy_config(checkpoint_dir: str | Path, **sections: Any) -> dict[str, Any]:
    """A toy run's config (``sections`` deep-merged in; None removes one): 64 rows at batch 4, 6 steps."""
    base = {
        "recipe": {"_target_": "automodel.testing.ToyRecipe"},
        "step_scheduler": {"max_steps": 6, "log_interval": 1, "num_epochs": 100},
        "rng": {"seed": 1234},
        "model": {"_target_": "automodel.testing.ToyModel"},
        "dataset": {"_target_": "automodel.testing.ToyDataset"},
        "dataloader": {"batch_size": 4},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1.0e-2},
        "checkpoint": {"checkpoint_dir": str(checkpoint_dir)},
    }
    return deep_update(base, sections)
