"""Safe YAML loading and dumping.

Only PyYAML's safe loader is used (no ``!!python/...`` tags). Two fixes over plain PyYAML: scientific
notation without a dot (``1e-4``) is a float as in YAML 1.2, and duplicate keys are an error rather than the
last one silently winning.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from automodel.errors import ConfigError, ConfigIssue


class _Loader(yaml.SafeLoader):
    pass


_FLOAT_WITHOUT_DOT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_WITHOUT_DOT, list("-+0123456789"))


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key}'", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_error_to_issue(err: yaml.YAMLError, source: str) -> ConfigIssue:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
    problem = getattr(err, "problem", None) or str(err)
    if "\t" in problem or "'\\t'" in problem:
        return ConfigIssue(where, "a tab character is used for indentation; YAML needs spaces")
    if "could not determine a constructor for the tag" in problem:
        tag = problem.split("tag", 1)[1].strip().strip("'").replace("tag:yaml.org,2002:", "!!")
        return ConfigIssue(where, f"the YAML tag {tag} is not allowed: configs are plain data "
                                  "(use `_target_` for objects)")
    return ConfigIssue(where, f"malformed YAML: {problem}")


def parse_yaml(text: str, source: str = "<config>") -> Any:
    """Parse YAML text with the safe loader; a syntax problem becomes a ConfigError naming the line."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error_to_issue(err, source)) from None


def load_yaml_file(path: str | Path) -> dict:
    """Load a config file: it must exist and hold a mapping at the top level."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(ConfigIssue("-c", f"config file '{path}' does not exist")) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise ConfigError(ConfigIssue("-c", f"config file '{path}' cannot be read: {err}")) from None
    data = parse_yaml(text, str(path))
    if data is None:
        raise ConfigError(ConfigIssue(str(path), "the config file is empty"))
    if not isinstance(data, dict):
        raise ConfigError(ConfigIssue(str(path), "the top level must be a mapping of sections, found "
                                                 f"{type(data).__name__}"))
    return data


def parse_scalar(text: str) -> Any:
    """Type a command-line value as a YAML scalar (``1e-4`` -> float, ``null`` -> None, ``[1,2]`` -> list)."""
    if text == "":
        return ""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506
    except yaml.YAMLError:
        return text


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
