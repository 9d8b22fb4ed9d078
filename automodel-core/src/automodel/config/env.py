"""Environment interpolation: ``${VAR}``, ``${VAR,default}``, ``${oc.env:VAR[,default]}`` and ``${pkg:NAME}``.

``${pkg:NAME}`` is the directory of the top-level package NAME of an installed distribution, so that shipped
example configs can point at files shipped beside them wherever they are copied. Interpolation loads nothing:
NAME must be listed in a distribution's metadata (the automodel plugins' first, then any installed one), and its
directory is found by the import system's finders without importing it (so no ``__init__.py`` runs) and never
in the current directory (so a local ``NAME/`` cannot stand in for the installed package).
"""

from __future__ import annotations

import os
import re
import sys
from importlib import machinery, metadata
from typing import Any

from automodel.config.registry import distribution_packages
from automodel.errors import ConfigIssue

_PLACEHOLDER = re.compile(r"\$\{(?:(oc\.env|pkg):)?([A-Za-z_][A-Za-z0-9_.]*)(?:,([^}]*))?\}")


def _installed_top_level_package(name: str) -> bool:
    plugin_dists = {ep.dist.metadata["Name"] for ep in metadata.entry_points(group="automodel") if ep.dist}
    if any(name in distribution_packages(dist) for dist in plugin_dists):
        return True
    return name in metadata.packages_distributions()  # slower: every installed distribution's files


def _is_working_directory(entry: str) -> bool:
    return entry in ("", ".") or os.path.realpath(entry) == os.path.realpath(os.getcwd())


def _package_dir(name: str) -> str | None:
    if not name.isidentifier() or not _installed_top_level_package(name):
        return None
    path = [entry for entry in sys.path if isinstance(entry, str) and not _is_working_directory(entry)]
    for finder in sys.meta_path:
        try:  # PathFinder over sys.path without the working directory; other finders (editable installs) as is
            spec = (machinery.PathFinder.find_spec(name, path) if finder is machinery.PathFinder
                    else finder.find_spec(name, None))
        except (ImportError, ValueError, AttributeError):
            continue
        if spec is not None and spec.submodule_search_locations:
            return list(spec.submodule_search_locations)[0]
    return None


def _substitute(value: str, key: str, issues: list[ConfigIssue]) -> Any:
    def replace(match: re.Match) -> str:
        kind, name, default = match.groups()
        if kind == "pkg":
            found = _package_dir(name)
            if found is None:
                issues.append(ConfigIssue(key, f"${{pkg:{name}}}: no installed distribution has a top-level package "
                                               f"named '{name}'"))
                return match.group(0)
            return found
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        issues.append(ConfigIssue(key, f"environment variable '{name}' is not set and has no default "
                                       f"(write ${{{name},default}} to give one)"))
        return match.group(0)

    whole = _PLACEHOLDER.fullmatch(value)
    result = _PLACEHOLDER.sub(replace, value)
    if whole and result != value:
        from automodel.config.yaml_io import parse_scalar

        return parse_scalar(result)  # a whole-value placeholder takes the value's YAML type
    return result


def interpolate(data: Any, issues: list[ConfigIssue], key: str = "") -> Any:
    """A copy of ``data`` with every placeholder replaced; unresolvable ones are added to ``issues``."""
    if isinstance(data, dict):
        return {k: interpolate(v, issues, f"{key}.{k}" if key else str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [interpolate(v, issues, f"{key}[{i}]") for i, v in enumerate(data)]
    if isinstance(data, str) and "${" in data:
        return _substitute(data, key, issues)
    return data
