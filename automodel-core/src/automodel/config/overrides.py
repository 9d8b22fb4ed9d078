"""Command-line overrides: ``--a.b.c value`` and ``--a.b.c=value``."""

from __future__ import annotations

import re
from typing import Any

from automodel.config.yaml_io import parse_scalar
from automodel.errors import ConfigError, ConfigIssue

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*$")


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Turn extra CLI arguments into (dotted key, typed value) pairs, in order."""
    pairs: list[tuple[str, Any]] = []
    issues: list[ConfigIssue] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            issues.append(ConfigIssue(arg, "unexpected argument; overrides look like --section.key value"))
            i += 1
            continue
        body = arg[2:]
        if "=" in body:
            key, text = body.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not (args[i + 1].startswith("--") and len(args[i + 1]) > 2):
            key, text = body, args[i + 1]
            i += 2
        else:
            issues.append(ConfigIssue(body or arg, "override has no value; write --key value or --key=value"))
            i += 1
            continue
        if not _KEY.match(key):
            issues.append(ConfigIssue(key, "not a valid dotted config key"))
            continue
        pairs.append((key, parse_scalar(text)))
    if issues:
        raise ConfigError(issues)
    return pairs


def apply_overrides(data: dict, pairs: list[tuple[str, Any]]) -> dict:
    """Set each dotted key in a copy of ``data``, creating intermediate sections as needed."""
    import copy

    data = copy.deepcopy(data)
    issues: list[ConfigIssue] = []
    for key, value in pairs:
        node = data
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                issues.append(ConfigIssue(key, f"cannot set a key inside '{where}', which is {child!r}, not a section"))
                break
            node = child
        else:
            node[parts[-1]] = value
    if issues:
        raise ConfigError(issues)
    return data
