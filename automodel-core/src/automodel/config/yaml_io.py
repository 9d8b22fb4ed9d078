"""Safe YAML loading and dumping.

Only PyYAML's safe loader is used (no ``!!python/...`` tags). Two fixes over plain PyYAML: scientific
notation without a dot (``1e-4``) is a float as in YAML 1.2, and duplicate keys are an error rather than the
last one silently winning. A config is untrusted, so the loader also caps what it may cost: the file's size
(:data:`MAX_CONFIG_BYTES`), its nesting depth (:data:`MAX_DEPTH`) and the number of values it expands to once
aliases (``*name``) repeat their anchors (:data:`MAX_VALUES`; the "billion laughs" a few lines long). The caps
are checked on the composed node graph, before any Python object is built.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from automodel.errors import ConfigError, ConfigIssue

MAX_CONFIG_BYTES = 8 * 1024 * 1024
MAX_DEPTH = 100
MAX_VALUES = 1_000_000


class _LimitError(yaml.YAMLError):
    """A config over one of the loader's caps; the message says which and what to do."""

    def __init__(self, message: str, mark: yaml.Mark | None = None):
        super().__init__(message)
        self.message, self.mark = message, mark


def _expanded_size(root: yaml.Node) -> tuple[int, int]:
    """(values, depth) of the document once every alias is expanded; iterative, each node measured once."""
    done: dict[int, tuple[int, int]] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in done:
            continue
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        if not children_done:
            if id(node) in active:
                raise _LimitError("an alias refers to the collection that contains it (a recursive alias)",
                                  node.start_mark)
            active.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in done)
            continue
        active.discard(id(node))
        values = 1 + sum(done[id(c)][0] for c in children)
        depth = 1 + max((done[id(c)][1] for c in children), default=0)
        if values > MAX_VALUES:
            raise _LimitError(f"the config expands to more than {MAX_VALUES:,} values (aliases `*name` repeat what "
                              "an anchor `&name` holds); refused as too large", node.start_mark)
        if depth > MAX_DEPTH:
            raise _LimitError(f"the config nests deeper than {MAX_DEPTH} levels (aliases included); refused",
                              node.start_mark)
        done[id(node)] = (values, depth)
    return done[id(root)]


class _Loader(yaml.SafeLoader):
    """The safe loader, with duplicate keys refused and the caps above enforced before anything is constructed."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:  # before PyYAML's own recursion would overflow the stack
                raise _LimitError(f"the config nests deeper than {MAX_DEPTH} levels; refused",
                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return self.construct_document(node)


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
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None) or getattr(err, "mark", None)
    where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
    if isinstance(err, _LimitError):
        return ConfigIssue(where, err.message)
    problem = getattr(err, "problem", None) or str(err)
    if "\t" in problem or "'\\t'" in problem:
        return ConfigIssue(where, "a tab character is used for indentation; YAML needs spaces")
    if "could not determine a constructor for the tag" in problem:
        tag = problem.split("tag", 1)[1].strip().strip("'").replace("tag:yaml.org,2002:", "!!")
        return ConfigIssue(where, f"the YAML tag {tag} is not allowed: configs are plain data "
                                  "(use `_target_` for objects)")
    return ConfigIssue(where, f"malformed YAML: {problem}")


def _too_large(size: int, source: str) -> ConfigError:
    return ConfigError(ConfigIssue(source, f"the config is {size:,} bytes, over the limit of {MAX_CONFIG_BYTES:,} "
                                           "bytes (8 MiB) for a config file; configs are small: point at data files "
                                           "instead of inlining them"))


def parse_yaml(text: str, source: str = "<config>") -> Any:
    """Parse YAML text with the safe loader; a syntax problem becomes a ConfigError naming the line."""
    if len(text) > MAX_CONFIG_BYTES:
        raise _too_large(len(text.encode("utf-8")), source)
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error_to_issue(err, source)) from None


def load_yaml_file(path: str | Path) -> dict:
    """Load a config file: it must exist and hold a mapping at the top level."""
    path = Path(path)
    try:
        if path.is_file() and path.stat().st_size > MAX_CONFIG_BYTES:
            raise _too_large(path.stat().st_size, str(path))
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
