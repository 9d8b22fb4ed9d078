"""Helpers for the diffusion domain's tests: the shipped examples, trained in-process, and their outputs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from automodel import testing
from automodel.testing import OFFLINE

for _name, _value in OFFLINE.items():
    os.environ.setdefault(_name, _value)

PKG_DIR = Path(importlib.util.find_spec("automodel_diffusion").submodule_search_locations[0])
EXAMPLES = PKG_DIR / "examples"
ASSETS = EXAMPLES / "assets"
SHAPES = ASSETS / "tiny_shapes"


def load_config(config: Path, *overrides: Any, route: tuple[str, str] = ("finetune", "diffusion")):
    """Validate a config for a route as the CLI does; returns (recipe class, config)."""
    return testing.load_config(config, *overrides, route=route)


def train_inprocess(config: Path, *overrides: Any, before_run=None):
    """Validate and run ``finetune diffusion`` in this process; returns the recipe after training."""
    return testing.train_inprocess(config, *overrides, route=("finetune", "diffusion"), before_run=before_run)


def cli(*args: Any) -> int:
    from automodel.cli.main import main

    return main([str(a) for a in args])


