"""Helpers for the diffusion domain's tests: the shipped examples, trained in-process, and their outputs."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PKG_DIR = Path(importlib.util.find_spec("automodel_diffusion").submodule_search_locations[0])
EXAMPLES = PKG_DIR / "examples"
ASSETS = EXAMPLES / "assets"
SHAPES = ASSETS / "tiny_shapes"


def load_config(config: Path, *overrides: Any, route: tuple[str, str] = ("finetune", "diffusion")):
    """Validate a config for a route as the CLI does; returns (recipe class, config)."""
    from automodel.cli.execute import import_recipe, load_and_validate
    from automodel.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    recipe_cls = import_recipe(manager.routes.get(*route).recipe)
    return recipe_cls, load_and_validate(recipe_cls, Path(config), [str(o) for o in overrides], manager)


def train_inprocess(config: Path, *overrides: Any, before_run=None):
    """Validate and run ``finetune diffusion`` in this process; returns the recipe after training."""
    recipe_cls, cfg = load_config(config, *overrides)
    recipe = recipe_cls(cfg)
    recipe.setup()
    if before_run is not None:
        before_run(recipe)
    recipe.run_train_validation_loop()
    return recipe


def cli(*args: Any) -> int:
    from automodel.cli.main import main

    return main([str(a) for a in args])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def losses_by_step(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(path)}  # a resumed run appends: the last line wins


def load_safetensors_state(directory: Path) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def assert_states_equal(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for key in a:
        x, y = a[key].detach().cpu(), b[key].detach().cpu()
        assert torch.equal(x, y), f"{key}: max |diff| {float((x.float() - y.float()).abs().max())}"
