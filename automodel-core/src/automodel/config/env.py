"""Interpolation: ``${NAME}``, ``${NAME,default}``, ``${oc.env:VAR[,default]}`` and ``${pkg:NAME}``.

``${NAME}`` is a reference to another config key when NAME is the dotted path of a key the config holds
(``${optimizer.lr}``; a number segment indexes a list: ``${dataset.files.0}``), else the environment variable NAME
(upstream NeMo AutoModel's rule, where ``${a.b.c}`` is an environment variable with dots in its name), else the
default after the comma. ``${oc.env:VAR}`` is always the environment. A reference whose placeholder is the whole
value takes the referenced value as it is (a number, a mapping); inside a longer string it must be a scalar. A
referenced value is interpolated first; a chain that comes back to itself is an error naming the chain.

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


def unknown_packages(text: str) -> list[str]:
    """The messages for each ``${pkg:NAME}`` in ``text`` that names no installed distribution's package (found
    without importing anything, as interpolation would resolve it)."""
    return [f"${{pkg:{name}}}: no installed distribution has a top-level package named '{name}'"
            for kind, name, _ in _PLACEHOLDER.findall(text) if kind == "pkg" and _package_dir(name) is None]


def _scalar_text(value: Any) -> str | None:
    """A referenced scalar as text inside a longer string (YAML spelling), or None for a mapping or a list."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float, str)):
        return str(value)
    return None


class _Interpolation:
    """One pass over a config: every placeholder replaced, each referenced key interpolated once, cycles caught."""

    def __init__(self, root: Any, issues: list[ConfigIssue]):
        self.root, self.issues = root, issues
        self.done: dict[str, Any] = {}  # key -> its interpolated string value
        self.active: list[str] = []  # the keys being interpolated now, outermost first

    def value(self, data: Any, key: str) -> Any:
        if isinstance(data, dict):
            return {k: self.value(v, f"{key}.{k}" if key else str(k)) for k, v in data.items()}
        if isinstance(data, list):
            return [self.value(v, f"{key}.{i}") for i, v in enumerate(data)]
        if isinstance(data, str) and "${" in data:
            return self.string(data, key)
        return data

    def string(self, text: str, key: str) -> Any:
        if key in self.done:
            return self.done[key]
        if key in self.active:
            chain = " -> ".join([*self.active[self.active.index(key):], key])
            self.issues.append(ConfigIssue(_shown(self.active[0]), f"the references form a cycle: {chain}; one of "
                                                                   "these keys needs a value of its own"))
            return text
        self.active.append(key)
        try:
            result = self.substitute(text, key)
        finally:
            self.active.pop()
        self.done[key] = result
        return result

    def lookup(self, path: str) -> tuple[bool, Any]:
        """Whether the config holds the key ``path`` (dots between mapping keys, numbers index lists), and its
        value as written."""
        node = self.root
        for part in path.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return False, None
        return True, node

    def substitute(self, text: str, key: str) -> Any:
        whole = _PLACEHOLDER.fullmatch(text)
        referenced: list[Any] = []

        def replace(match: re.Match) -> str:
            kind, name, default = match.groups()
            if kind == "pkg":
                found = _package_dir(name)
                if found is None:
                    self.issues += [ConfigIssue(_shown(key), message) for message in unknown_packages(match.group(0))]
                    return match.group(0)
                return found
            if kind is None:
                exists, raw = self.lookup(name)
                if exists:
                    value = self.value(raw, name)
                    referenced.append(value)
                    text = _scalar_text(value)
                    if text is None and not whole:
                        self.issues.append(ConfigIssue(_shown(key), f"${{{name}}} is a {type(value).__name__}; "
                                                                    "only a whole value may reference a section or "
                                                                    "a list"))
                        return match.group(0)
                    return text if text is not None else match.group(0)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            nor_key = "" if kind else ", the config has no key of that name,"
            self.issues.append(ConfigIssue(_shown(key), f"environment variable '{name}' is not set{nor_key} and the "
                                                        f"placeholder has no default (write ${{{name},default}} to "
                                                        "give one)"))
            return match.group(0)

        result = _PLACEHOLDER.sub(replace, text)
        if whole and referenced:
            return referenced[0]  # a whole-value reference takes the referenced value as it is
        if whole and result != text:
            from automodel.config.yaml_io import parse_scalar

            return parse_scalar(result)  # a whole-value placeholder takes the value's YAML type
        return result


def _shown(path: str) -> str:
    """A key as issues spell it: list items as ``a.b[0]``."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", path)


def interpolate(data: Any, issues: list[ConfigIssue], key: str = "", root: Any = None) -> Any:
    """A copy of ``data`` with every placeholder replaced; unresolvable ones are added to ``issues``. References
    look keys up in ``root`` (default: ``data``), so a part of a config can be interpolated against all of it."""
    return _Interpolation(data if root is None else root, issues).value(data, key)
