"""Building objects from ``_target_`` nodes: nested nodes first, caller's runtime arguments win."""

from __future__ import annotations

from typing import Any

from automodel.config.targets import TargetError, TargetResolver
from automodel.errors import AutomodelError, ConfigError, ConfigIssue


class BuildError(AutomodelError):
    """Calling a target failed; names the config node so the user knows which section to fix."""

    def __init__(self, key: str, target: str, err: BaseException):
        self.key, self.target, self.error = key, target, err
        super().__init__(f"{key}: building {target} failed: {type(err).__name__}: {err}")


def is_target_node(value: Any) -> bool:
    return isinstance(value, dict) and "_target_" in value


def _build(value: Any, resolver: TargetResolver, key: str) -> Any:
    if is_target_node(value):
        return instantiate(value, resolver, key)
    if isinstance(value, dict):
        return {k: _build(v, resolver, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_build(v, resolver, f"{key}[{i}]") for i, v in enumerate(value)]
    return value


def instantiate(node: dict, resolver: TargetResolver, key: str, default_target: str | None = None,
                **runtime: Any) -> Any:
    """Call ``node['_target_']`` (or ``default_target``) with the node's other keys as keyword arguments.

    Nested target nodes are built first; ``runtime`` arguments supplied by the caller (model parameters for an
    optimizer, a tokenizer for a dataset) override the config's values.
    """
    target = node.get("_target_", default_target)
    try:
        fn = resolver.resolve(target)
    except TargetError as err:
        raise ConfigError(ConfigIssue(f"{key}._target_", str(err), err.suggestion)) from None
    kwargs = {k: _build(v, resolver, f"{key}.{k}") for k, v in node.items() if k != "_target_"}
    kwargs.update(runtime)
    try:
        return fn(**kwargs)
    except AutomodelError:
        raise
    except Exception as err:  # a user's config reached a library that refused it: say which node
        raise BuildError(key, str(target), err) from err
