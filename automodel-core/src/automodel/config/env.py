"""Environment interpolation: ``${VAR}``, ``${VAR,default}``, ``${oc.env:VAR[,default]}`` and ``${pkg:NAME}``.

``${pkg:NAME}`` is the directory of the installed Python package NAME (found without importing it), so that
shipped example configs can point at files shipped beside them wherever they are copied.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

from automodel.errors import ConfigIssue

_PLACEHOLDER = re.compile(r"\$\{(?:(oc\.env|pkg):)?([A-Za-z_][A-Za-z0-9_.]*)(?:,([^}]*))?\}")


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _substitute(value: str, key: str, issues: list[ConfigIssue]) -> Any:
    def replace(match: re.Match) -> str:
        kind, name, default = match.groups()
        if kind == "pkg":
            found = _package_dir(name)
            if found is None:
                issues.append(ConfigIssue(key, f"${{pkg:{name}}}: no installed Python package named '{name}'"))
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
