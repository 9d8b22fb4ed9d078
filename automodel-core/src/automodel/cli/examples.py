"""Shipped example configs: ``<package>/examples/*.yaml``, named ``<domain>/<stem>`` (``llm/tiny_squad``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from automodel.plugins.manager import PluginManager


def _package_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def list_examples(manager: PluginManager) -> dict[str, Path]:
    """Every shipped example of every installed route's package, found without importing the packages."""
    found: dict[str, Path] = {}
    packages = sorted({route.recipe.split(".")[0] for route in manager.routes.routes.values()})
    for package in packages:
        root = _package_dir(package)
        if root is None or not (root / "examples").is_dir():
            continue
        prefix = package.removeprefix("automodel_").replace("_", "-")
        for path in sorted((root / "examples").glob("*.yaml")):
            found[f"{prefix}/{path.stem}"] = path
    return found


def find_example(name: str, manager: PluginManager) -> Path | None:
    return list_examples(manager).get(name.removesuffix(".yaml"))
