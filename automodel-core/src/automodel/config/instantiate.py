"""Building objects from ``_target_`` nodes: nested nodes first, caller's runtime arguments win.

A key ending in ``_fn`` (``collate_fn``, ``worker_init_fn``) inside a section names a callable that is *passed*, not
called (upstream NeMo AutoModel's rule): a dotted string is that callable; a ``_target_`` node is its callable as
is, or a ``functools.partial`` binding the node's other keys when it has any. A top-level section whose name ends
in ``_fn`` (``loss_fn``) is a section like any other: it is built.
"""

from __future__ import annotations

import functools
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


def is_callable_key(key: str) -> bool:
    """Whether the dotted key (``dataloader.collate_fn``) names a callable that is passed, not called."""
    return "." in key and key.rsplit(".", 1)[-1].endswith("_fn")


def _resolve(name: Any, resolver: TargetResolver, key: str) -> Any:
    try:
        return resolver.resolve(name)
    except TargetError as err:
        raise ConfigError(ConfigIssue(key, str(err), err.suggestion)) from None


def callable_value(value: Any, resolver: TargetResolver, key: str) -> Any:
    """What a ``*_fn`` key passes: the callable a dotted string names, or a target node's callable (a
    ``functools.partial`` with the node's other keys, built first, when it has any). Nothing is called here."""
    if isinstance(value, str):
        return _resolve(value, resolver, key)
    if is_target_node(value):
        fn = _resolve(value["_target_"], resolver, f"{key}._target_")
        kwargs = {k: _build(v, resolver, f"{key}.{k}") for k, v in value.items() if k != "_target_"}
        return functools.partial(fn, **kwargs) if kwargs else fn
    return value  # null, or a mapping without _target_: passed as written


def build_value(value: Any, resolver: TargetResolver, key: str) -> Any:
    """A config value as a target receives it: target nodes built, ``*_fn`` keys' callables resolved."""
    return _build(value, resolver, key)


def _build(value: Any, resolver: TargetResolver, key: str) -> Any:
    if is_callable_key(key):
        return callable_value(value, resolver, key)
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
    fn = _resolve(target, resolver, f"{key}._target_")
    kwargs = {k: _build(v, resolver, f"{key}.{k}") for k, v in node.items() if k != "_target_"}
    kwargs.update(runtime)
    try:
        return fn(**kwargs)
    except AutomodelError:
        raise
    except Exception as err:  # a user's config reached a library that refused it: say which node
        raise BuildError(key, str(target), err) from err
