"""The config system: safe YAML, environment interpolation, overrides, ``_target_`` resolution, validation."""

from __future__ import annotations

import dataclasses
from typing import Any

from automodel.config.code_loading import code_loading_issues
from automodel.config.env import interpolate
from automodel.config.instantiate import BuildError, instantiate, is_target_node
from automodel.config.model_paths import model_path_issues
from automodel.config.node import Config, ConfigNode
from automodel.config.overrides import apply_overrides, parse_overrides
from automodel.config.registry import Registration, TargetRegistry
from automodel.config.schema import FieldErrors, require_positive, validate_sections
from automodel.config.secrets import is_secret_key, mask_secrets
from automodel.config.specs import (
    ArgumentsFor,
    Free,
    KeyAlias,
    Metadata,
    Refused,
    Target,
    alias_notes,
    is_inert,
    metadata_note,
)
from automodel.config.targets import TargetError, TargetResolver, core_registry
from automodel.config.trust import UserTrust
from automodel.config.unread import unread_section_issues
from automodel.config.yaml_io import dump_yaml, load_yaml_file, parse_scalar, parse_yaml
from automodel.errors import ConfigError, ConfigIssue

__all__ = [
    "ArgumentsFor", "BuildError", "Config", "ConfigNode", "FieldErrors", "Free", "KeyAlias", "Metadata", "Refused",
    "Registration", "Target", "TargetError", "TargetRegistry", "TargetResolver", "UserTrust", "apply_overrides",
    "build_config", "core_registry", "dump_yaml", "instantiate", "interpolate", "is_secret_key", "is_target_node",
    "load_yaml_file", "mask_secrets", "parse_overrides", "parse_scalar", "parse_yaml", "require_positive",
]


def build_config(data: dict, recipe_cls: Any, resolver: TargetResolver, source: str = "<config>",
                 overrides: list[tuple[str, Any]] = ()) -> Config:
    """Apply overrides, interpolate, validate against the recipe; raise one ConfigError listing every problem."""
    raw = apply_overrides(data, list(overrides))
    issues: list[ConfigIssue] = []
    declared = recipe_cls.all_sections()
    # metadata and refused sections are left as written: nothing reads them, so nothing in them is checked (a
    # reference may still read a value there: `_vars: {lr: 1e-3}` and `lr: ${_vars.lr}`)
    read = interpolate({k: v for k, v in raw.items() if not is_inert(k, declared)}, issues, root=raw)
    resolved = {k: read.get(k, v) for k, v in raw.items()}
    values = validate_sections(resolved, declared, resolver, issues)
    issues += code_loading_issues(read, resolver.trust.remote_code)
    issues += model_path_issues(read)
    issues += unread_section_issues({k: v for k, v in raw.items() if is_inert(k, declared)}, resolver)
    sections = {
        name: ConfigNode(value, name, resolver) if isinstance(value, dict) else value
        for name, value in values.items()
    }
    for name in declared:
        sections.setdefault(name, None)
    note = metadata_note(raw, declared)
    notes = ([note] if note else []) + alias_notes(resolved, declared)
    cfg = Config(raw, resolved, sections, resolver, source, notes=notes)
    issues += recipe_cls.check_config(cfg)
    if issues:
        raise ConfigError(issues)
    return cfg


def section_defaults(cls: type) -> dict[str, Any]:
    """A dataclass section's default values (for docs and ``--print-config``)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
