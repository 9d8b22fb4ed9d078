"""Registries that hooks fill. Each records which plugin added what, so conflicts name both sides."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from automodel.errors import PluginError
from automodel.training.pipeline import PIPELINE_SLOTS


class _Registry:
    def __init__(self) -> None:
        self.source = "core"  # set by the manager to the plugin being called

    def _conflict(self, what: str, first: str, second: str) -> PluginError:
        return PluginError(f"{what} is registered by both '{first}' and '{second}'; uninstall or disable one "
                           "(AUTOMODEL_DISABLE_PLUGINS=name)")


@dataclass
class Route:
    command: str
    domain: str
    recipe: str
    help: str = ""
    examples: list[str] = field(default_factory=list)
    source: str = "core"


class RouteRegistry(_Registry):
    def __init__(self) -> None:
        super().__init__()
        self.routes: dict[tuple[str, str], Route] = {}
        self.conflicts: dict[tuple[str, str], str] = {}

    def add(self, command: str, domain: str, recipe: str, help: str = "", examples: Iterable[str] = ()) -> None:
        for what, value in (("command", command), ("domain", domain)):
            if not isinstance(value, str) or not value or not value.replace("-", "").replace("_", "").isalnum():
                raise PluginError(f"route {what} must be a word such as 'finetune', got {value!r}")
        if not isinstance(recipe, str) or "." not in recipe:
            raise PluginError(f"route {command} {domain}: recipe must be a dotted path 'pkg.module.Class'")
        key = (command, domain)
        if key in self.routes:
            error = self._conflict(f"route '{command} {domain}'", self.routes[key].source, self.source)
            self.conflicts[key] = str(error)
            raise error
        self.routes[key] = Route(command, domain, recipe, help, list(examples), self.source)

    def commands(self) -> list[str]:
        return sorted({c for c, _ in self.routes})

    def domains(self, command: str) -> list[str]:
        return sorted(d for c, d in self.routes if c == command)

    def get(self, command: str, domain: str) -> Route | None:
        return self.routes.get((command, domain))


class AliasRegistry(_Registry):
    def __init__(self) -> None:
        super().__init__()
        self.commands: dict[str, str] = {}
        self.domains: dict[str, str] = {}
        self.targets: dict[str, str] = {}
        self.unsupported_targets: dict[str, str] = {}
        self.recipes: dict[str, str] = {}  # recipe name -> "command domain" (the route it selects)
        self._sources: dict[tuple[str, str], str] = {}

    def _add(self, kind: str, table: dict[str, str], alias: str, target: str) -> None:
        if not alias or not target:
            raise PluginError(f"{kind} alias needs a name and a target, got {alias!r} -> {target!r}")
        if alias in table and table[alias] != target:
            raise self._conflict(f"{kind} alias '{alias}'", self._sources[(kind, alias)], self.source)
        table[alias] = target
        self._sources[(kind, alias)] = self.source

    def command(self, alias: str, command: str) -> None:
        self._add("command", self.commands, alias, command)

    def domain(self, alias: str, domain: str) -> None:
        self._add("domain", self.domains, alias, domain)

    def target(self, alias: str, dotted_path: str) -> None:
        self._add("target", self.targets, alias, dotted_path)

    def unsupported(self, name: str, reason: str) -> None:
        """A name configs may write (an upstream one, say) that nothing here implements: resolving it is refused
        with ``reason``, which should say what to use instead."""
        self._add("unsupported target", self.unsupported_targets, name, reason)

    def recipe(self, name: str, command: str, domain: str) -> None:
        """A name a config's ``recipe:`` may give (an upstream recipe class name or its dotted path) for the
        installed route ``command domain``: ``recipe: Name`` then runs that route's recipe."""
        self._add("recipe", self.recipes, name, f"{command} {domain}")

    def target_source(self, alias: str) -> str:
        """The distribution that registered a target alias."""
        return self.source_of("target", alias)

    def source_of(self, kind: str, alias: str) -> str:
        """The distribution that registered an alias of ``kind`` (command, domain, target, recipe,
        unsupported target: a refused name)."""
        return self._sources[(kind, alias)]


@dataclass
class Builder:
    name: str
    fn: Callable | str
    domain: str | None
    source: str


class BuilderRegistry(_Registry):
    """Builders by component name; a domain-specific builder wins over the default for that domain."""

    def __init__(self) -> None:
        super().__init__()
        self.builders: dict[tuple[str, str | None], Builder] = {}

    def add(self, name: str, fn: Callable | str, domain: str | None = None) -> None:
        key = (name, domain)
        if key in self.builders and self.builders[key].source != self.source:
            where = f"builder '{name}'" + (f" for domain '{domain}'" if domain else "")
            raise self._conflict(where, self.builders[key].source, self.source)
        self.builders[key] = Builder(name, fn, domain, self.source)

    def get(self, name: str, domain: str | None = None) -> Callable:
        builder = self.builders.get((name, domain)) or self.builders.get((name, None))
        if builder is None:
            raise KeyError(f"no builder registered for '{name}'")
        return _load(builder.fn)

    def names(self) -> list[str]:
        return sorted({n for n, _ in self.builders})


@dataclass
class Stage:
    slot: str
    name: str
    fn: Callable | str
    source: str


class StageRegistry(_Registry):
    def __init__(self) -> None:
        super().__init__()
        self.stages: dict[tuple[str, str], Stage] = {}

    def add(self, slot: str, name: str, fn: Callable | str) -> None:
        if slot not in PIPELINE_SLOTS:
            raise PluginError(f"unknown pipeline slot '{slot}'; the slots are: {', '.join(PIPELINE_SLOTS)}")
        key = (slot, name)
        if key in self.stages:
            raise self._conflict(f"stage '{name}' in slot '{slot}'", self.stages[key].source, self.source)
        self.stages[key] = Stage(slot, name, fn, self.source)

    def implementations(self, slot: str) -> dict[str, Stage]:
        return {name: stage for (s, name), stage in self.stages.items() if s == slot}

    def get(self, slot: str, name: str) -> Callable | None:
        stage = self.stages.get((slot, name))
        return None if stage is None else _load(stage.fn)


class LoggerRegistry(_Registry):
    def __init__(self) -> None:
        super().__init__()
        self.loggers: dict[str, tuple[Callable | str, str]] = {}

    def add(self, name: str, factory: Callable | str) -> None:
        if name in self.loggers:
            raise self._conflict(f"logger '{name}'", self.loggers[name][1], self.source)
        self.loggers[name] = (factory, self.source)

    def get(self, name: str) -> Callable | None:
        entry = self.loggers.get(name)
        return None if entry is None else _load(entry[0])


def _load(fn: Callable | str) -> Any:
    """Import a registered dotted path lazily (registration stays cheap; the import happens on use)."""
    if callable(fn):
        return fn
    import importlib

    module, _, attr = fn.rpartition(".")
    return getattr(importlib.import_module(module), attr)
