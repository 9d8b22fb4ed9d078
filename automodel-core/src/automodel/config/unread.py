"""The security checks for the sections nothing in a run reads (metadata such as ``ci:``, ``_``-keys, refused ones).

Those sections are neither interpolated nor validated as settings, so nothing in them runs here. They are still
refused when they hold a ``_target_`` or ``*_fn`` dotted path that could run arbitrary code (the refused modules;
whether it is registered does not matter where nothing calls it: upstream sets sections aside with a ``_`` prefix,
targets and all) and a ``${pkg:NAME}`` naming no installed distribution's package (a reference may interpolate the
value later). A key that would load a model's code is left alone there: it loads nothing here, and upstream's own
CI settings carry ``trust_remote_code: true`` for their tooling (``ci.checkpoint_robustness``).
"""

from __future__ import annotations

from typing import Any

from automodel.config.env import unknown_packages
from automodel.config.targets import TargetError, TargetResolver
from automodel.errors import ConfigIssue


def unread_section_issues(sections: dict[str, Any], resolver: TargetResolver) -> list[ConfigIssue]:
    """Every code-bearing value in ``sections`` (top-level name -> content as written)."""
    issues: list[ConfigIssue] = []
    for name, value in sections.items():
        _walk(str(name), value, resolver, issues)
    return issues


def _walk(key: str, value: Any, resolver: TargetResolver, issues: list[ConfigIssue]) -> None:
    if isinstance(value, dict):
        if "_target_" in value:
            _check(f"{key}._target_", value["_target_"], resolver, issues)
        for child, item in value.items():
            if str(child).endswith("_fn") and isinstance(item, str):  # upstream's rule: a callable's dotted path
                _check(f"{key}.{child}", item, resolver, issues)
            else:
                _walk(f"{key}.{child}", item, resolver, issues)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _walk(f"{key}[{index}]", item, resolver, issues)
    elif isinstance(value, str):
        issues += [ConfigIssue(key, message) for message in unknown_packages(value)]


def _check(key: str, name: Any, resolver: TargetResolver, issues: list[ConfigIssue]) -> None:
    try:
        resolver.check_unread(name)
    except TargetError as err:
        issues.append(ConfigIssue(key, f"{err} (in a section nothing here reads: a tool that reads it would call it)"))


__all__ = ["unread_section_issues"]
