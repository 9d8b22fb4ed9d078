"""The validated config: attribute access into sections, the raw text kept for printing and saving."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from automodel.config.instantiate import instantiate
from automodel.config.secrets import mask_secrets
from automodel.config.targets import TargetResolver
from automodel.config.yaml_io import dump_yaml


class ConfigNode(Mapping):
    """A read-only mapping section with attribute access (``cfg.model.name_or_path``)."""

    def __init__(self, data: dict, key: str, resolver: TargetResolver):
        self._data, self._key, self._resolver = data, key, resolver

    def _wrap(self, name: str, value: Any) -> Any:
        if isinstance(value, dict):
            return ConfigNode(value, f"{self._key}.{name}", self._resolver)
        return value

    def __getitem__(self, name: str) -> Any:
        return self._wrap(name, self._data[name])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config section '{self._key}' has no key '{name}'") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"ConfigNode({self._key}: {self._data!r})"

    @property
    def key(self) -> str:
        return self._key

    @property
    def resolver(self) -> TargetResolver:
        return self._resolver

    @property
    def target(self) -> str | None:
        return self._data.get("_target_")

    def to_dict(self) -> dict:
        return copy.deepcopy(self._data)

    def instantiate(self, default_target: str | None = None, **runtime: Any) -> Any:
        return instantiate(self._data, self._resolver, self._key, default_target=default_target, **runtime)


class Config:
    """A config validated against a recipe's sections.

    ``raw`` keeps ``${VAR}`` placeholders (what is printed and saved); ``resolved`` has them substituted (what
    is built). Dataclass sections are dataclass instances; other sections are ``ConfigNode``; a declared
    section that is absent reads as its dataclass defaults or None.
    """

    def __init__(self, raw: dict, resolved: dict, sections: dict[str, Any], resolver: TargetResolver,
                 source: str = "<config>", notes: list[str] | None = None):
        self.raw, self.resolved, self.resolver, self.source = raw, resolved, resolver, source
        self.notes = list(notes or [])  # what validation tells the user besides errors (printed once per run)
        self._sections = sections

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._sections[name]
        except KeyError:
            raise AttributeError(f"the config has no section '{name}'") from None

    def __contains__(self, name: str) -> bool:
        return name in self.resolved and self.resolved[name] is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self._sections.get(name)
        return default if value is None else value

    def section_names(self) -> list[str]:
        """The sections the config gives: as written, then the built ones (a ``_target_`` section or a mapping)
        that upstream's keys of another section set (a recipe's ``recipe_args:``)."""
        set_elsewhere = [name for name, value in self._sections.items()
                         if name not in self.resolved and isinstance(value, (dict, ConfigNode))]
        return [*self.resolved, *set_elsewhere]

    def to_yaml(self) -> str:
        """The config as written plus overrides, placeholders kept and secrets masked."""
        return dump_yaml(mask_secrets(self.raw))
