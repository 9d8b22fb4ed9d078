"""Discovering and loading plugins, each under its own guard, and filling the registries.

Plugins are modules named by entry points in the ``automodel`` group. A plugin that fails to import, or that
raises inside a hook, is recorded (``automodel plugins`` shows it) and never takes the CLI down. The core's own
defaults are registered through the same hooks, first, so nothing a plugin registers can shadow them.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from automodel.config.registry import TargetRegistry, classify, distribution_packages
from automodel.config.targets import InstalledRecipes, TargetResolver
from automodel.plugins import hookspecs
from automodel.plugins.markers import PROJECT
from automodel.plugins.registries import (
    AliasRegistry,
    BuilderRegistry,
    LoggerRegistry,
    RouteRegistry,
    StageRegistry,
)

ENTRY_POINT_GROUP = "automodel"
DISABLE_ENV = "AUTOMODEL_DISABLE_PLUGINS"
CORE_PLUGIN = "automodel.builtin_plugin"
HOOK_NAMES = tuple(name for name in dir(hookspecs) if name.startswith("automodel_"))


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str
    hooks: list[str] = field(default_factory=list)
    error: str | None = None  # failed to import
    hook_errors: dict[str, str] = field(default_factory=dict)  # hook name -> what it raised

    @property
    def ok(self) -> bool:
        return self.error is None and not self.hook_errors

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "distribution": self.distribution, "version": self.version,
                "module": self.module, "hooks": self.hooks, "error": self.error, "hook_errors": self.hook_errors,
                "ok": self.ok}


def disabled_plugins() -> set[str]:
    return {p.strip() for p in os.environ.get(DISABLE_ENV, "").split(",") if p.strip()}


class PluginManager:
    """The loaded plugins and the registries they filled."""

    def __init__(self, load_entry_points: bool = True, extra_plugins: list[tuple[str, Any]] = ()):
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.routes = RouteRegistry()
        self.aliases = AliasRegistry()
        self.builders = BuilderRegistry()
        self.stages = StageRegistry()
        self.loggers = LoggerRegistry()
        self.targets = TargetRegistry()
        self._register_core()
        if load_entry_points:
            self._load_entry_points()
        for name, plugin in extra_plugins:
            self.register(plugin, PluginInfo(name, name, "0", getattr(plugin, "__name__", repr(plugin))))
        self._collect()

    # ---- loading ----------------------------------------------------------------------------------------

    def _register_core(self) -> None:
        try:
            version = metadata.version("automodel-core")
        except metadata.PackageNotFoundError:
            version = "0+unknown"
        module = importlib.import_module(CORE_PLUGIN)
        self.register(module, PluginInfo("core", "automodel-core", version, CORE_PLUGIN))

    def _load_entry_points(self) -> None:
        skip = disabled_plugins()
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else ep.name
            version = dist.version if dist is not None else "0+unknown"
            if ep.name == "core" or ep.value == CORE_PLUGIN or ep.name in skip or dist_name in skip:
                continue
            if ep.name in self.plugins:
                other = self.plugins[ep.name]
                self.plugins[f"{ep.name}@{dist_name}"] = PluginInfo(
                    ep.name, dist_name, version, ep.value,
                    error=f"plugin name '{ep.name}' is already used by distribution '{other.distribution}'")
                continue
            info = PluginInfo(ep.name, dist_name, version, ep.value)
            try:
                module = ep.load()
            except BaseException as err:  # noqa: BLE001 - a broken plugin must not break the CLI
                if isinstance(err, KeyboardInterrupt):
                    raise
                info.error = f"Error importing plugin '{ep.name}': {type(err).__name__}: {err}"
                self.plugins[ep.name] = info
                continue
            self.register(module, info)

    def register(self, plugin: ModuleType | Any, info: PluginInfo) -> None:
        try:
            self.pm.register(plugin, name=info.name)
        except Exception as err:  # noqa: BLE001 - a hookimpl that does not match its spec: record, go on
            if self.pm.get_plugin(info.name) is not None:  # pluggy may have added some of its hooks already
                self.pm.unregister(name=info.name)
            info.error = f"plugin '{info.name}' cannot be registered: {type(err).__name__}: {err}"
            self.plugins[info.name] = info
            return
        info.hooks = sorted(impl.name for impl in self.pm.get_hookcallers(plugin) or [])
        self.plugins[info.name] = info

    # ---- calling hooks ----------------------------------------------------------------------------------

    def call_each(self, hook_name: str, registry: Any = None, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call one hook on every plugin in registration order, each guarded; returns (plugin, result) pairs."""
        results = []
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            info = self.plugins.get(impl.plugin_name)
            if registry is not None:
                registry.source = info.distribution if info else impl.plugin_name
            try:
                results.append((impl.plugin_name, impl.function(**kwargs)))
            except Exception as err:  # noqa: BLE001 - recorded against the plugin, others continue
                if info is not None:
                    info.hook_errors[hook_name] = f"{type(err).__name__}: {err}"
        if registry is not None:
            registry.source = "core"
        return results

    def _collect(self) -> None:
        self.call_each("automodel_register_routes", self.routes, routes=self.routes)
        self.call_each("automodel_register_aliases", self.aliases, aliases=self.aliases)
        self._check_recipe_names()
        self.call_each("automodel_register_builders", self.builders, builders=self.builders)
        self.call_each("automodel_register_stages", self.stages, stages=self.stages)
        self.call_each("automodel_register_loggers", self.loggers, loggers=self.loggers)
        for name, names in self.call_each("automodel_allowed_targets"):
            if names is None:
                continue
            info = self.plugins[name]
            if isinstance(names, str) or not isinstance(names, (list, tuple)):
                info.hook_errors["automodel_allowed_targets"] = (
                    f"must return a list of dotted names (exact callables, or its own package), returned {names!r}")
                continue
            registrations, problems = classify(names, owned_packages(info), info.distribution)
            for registration in registrations:
                self.targets.add(registration)
            if problems:
                info.hook_errors["automodel_allowed_targets"] = "; ".join(problems)

    def _check_recipe_names(self) -> None:
        """A recipe name must select an installed route; one that does not is its plugin's hook error."""
        for name, route in list(self.aliases.recipes.items()):
            if self.routes.get(*route.split(" ", 1)) is None:
                del self.aliases.recipes[name]
                source = self.aliases.source_of("recipe", name)
                info = next((p for p in self.plugins.values() if source in (p.distribution, p.name)), None)
                if info is not None:
                    info.hook_errors["automodel_register_aliases"] = (
                        f"recipe name '{name}' selects the route '{route}', which no installed plugin registers")

    def register_commands(self, cli: Any) -> None:
        self.call_each("automodel_register_commands", cli=cli)

    # ---- queries ----------------------------------------------------------------------------------------

    def resolver(self) -> TargetResolver:
        """A resolver over every plugin's registrations and aliases, plus what the person running trusts."""
        return TargetResolver(self.targets, self.aliases.targets, unsupported=self.aliases.unsupported_targets,
                              recipes=self.installed_recipes())

    def installed_recipes(self) -> InstalledRecipes:
        """Each route's recipe by its dotted path, and the recipe names registered for the routes."""
        paths: dict[str, str] = {}
        routes: dict[str, tuple[str, ...]] = {}
        for route in sorted(self.routes.routes.values(), key=lambda r: (r.command, r.domain)):
            paths[route.recipe] = route.recipe
            routes[route.recipe] = (*routes.get(route.recipe, ()), f"{route.command} {route.domain}")
        for name, route in self.aliases.recipes.items():
            paths[name] = self.routes.get(*route.split(" ", 1)).recipe
        return InstalledRecipes(paths, routes)

    def failed(self) -> list[PluginInfo]:
        return [info for info in self.plugins.values() if not info.ok]


def owned_packages(info: PluginInfo) -> set[str]:
    """The top-level packages a plugin's distribution ships (its metadata), else its plugin module's package."""
    return distribution_packages(info.distribution) or {info.module.split(".")[0].split(":")[0]}


_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    global _manager
    if _manager is None:
        _manager = PluginManager()
    return _manager


def reset_plugin_manager(manager: PluginManager | None = None) -> None:
    """Replace the process-wide manager (tests register plugin objects this way)."""
    global _manager
    _manager = manager
