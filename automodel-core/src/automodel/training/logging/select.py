"""Choosing the backends a config asks for (``logging:`` and the upstream ``wandb:`` / ``mlflow:`` sections), each
with validated settings; every problem is a config issue found before anything is built."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from automodel.config.schema import validate_dataclass
from automodel.errors import ConfigIssue
from automodel.suggest import did_you_mean
from automodel.training.logging.base import MetricLogger

UPSTREAM_SECTIONS = ("wandb", "mlflow")  # top-level sections that mean "use this backend with these settings"
_ENABLE_KEYS = ("enable", "enabled")


@dataclass
class BackendSpec:
    name: str
    key: str  # the config key that asked for it
    factory: Callable[..., MetricLogger]
    settings: Any


def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _plain(value: Any) -> Any:
    return value.to_dict() if hasattr(value, "to_dict") and callable(value.to_dict) else value


def resolve_backends(cfg: Any, registry: Any) -> tuple[list[BackendSpec], list[ConfigIssue]]:
    """The backends the config asks for, each with validated settings, and every problem found.

    ``registry`` is the plugin manager's LoggerRegistry. Unknown names, settings that do not fit the backend and
    backends whose package is missing are issues, so that they fail validation before anything is built.
    """
    issues: list[ConfigIssue] = []
    registered = sorted(registry.loggers)
    listing = ", ".join(registered) or "none"
    requested: dict[str, str] = {}  # backend -> config key that asked for it
    settings: dict[str, tuple[str, dict]] = {}  # backend -> (config key, settings mapping)

    section = _plain(cfg.get("logging"))
    if isinstance(section, (list, str)):
        section = {"backends": section}
    if section is None:
        section = {}
    if not isinstance(section, dict):
        issues.append(ConfigIssue("logging", f"expected a section such as {{backends: [tensorboard]}}, found "
                                             f"{section!r}"))
        section = {}
    backends = section.get("backends") or []
    if isinstance(backends, str):
        backends = [backends]
    if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
        issues.append(ConfigIssue("logging.backends", f"expected a list of backend names such as [tensorboard, "
                                                      f"mlflow], found {backends!r}"))
        backends = []
    for i, name in enumerate(backends):
        requested.setdefault(name, f"logging.backends[{i}]")
    for name, value in section.items():
        if name == "backends":
            continue
        key = f"logging.{name}"
        if name not in registry.loggers:
            issues.append(ConfigIssue(key, f"unknown key; 'logging' accepts: backends, and the settings of a "
                                           f"registered backend: {listing}", did_you_mean(str(name),
                                                                                          ["backends", *registered])))
            continue
        if value is None:
            value = {}
        if not isinstance(value, dict):
            issues.append(ConfigIssue(key, f"expected the {name} backend's settings (a mapping), found {value!r}"))
            continue
        settings[name] = (key, value)
        requested.setdefault(name, key)
    for name in UPSTREAM_SECTIONS:
        value = _plain(cfg.get(name))
        if value is None:
            continue
        if not isinstance(value, dict):
            issues.append(ConfigIssue(name, f"expected the {name} backend's settings (a mapping), found {value!r}"))
            continue
        if name in settings:
            issues.append(ConfigIssue(name, f"the {name} backend's settings are given twice, as '{name}' and as "
                                            f"'logging.{name}'; keep one"))
            continue
        settings[name] = (name, value)
        requested.setdefault(name, name)

    specs: list[BackendSpec] = []
    for name, key in requested.items():
        settings_key, values = settings.get(name, (f"logging.{name}", {}))
        values = dict(values)
        enable = True
        for flag in _ENABLE_KEYS:
            if flag in values:
                enable = values.pop(flag)
                if not isinstance(enable, bool):
                    issues.append(ConfigIssue(f"{settings_key}.{flag}", f"expected true or false, found {enable!r}"))
        if enable is not True:
            continue
        if name not in registry.loggers:
            issues.append(ConfigIssue(key, f"unknown logging backend '{name}'; the registered backends are: "
                                           f"{listing}", did_you_mean(name, registered)))
            continue
        try:
            factory = registry.get(name)
        except Exception as err:  # noqa: BLE001 - a plugin's broken backend is a config issue, not a crash
            source = registry.loggers[name][1]
            issues.append(ConfigIssue(key, f"the {name} backend (registered by '{source}') cannot be imported: "
                                           f"{type(err).__name__}: {err}"))
            continue
        missing = [m for m in getattr(factory, "requires", ()) if not module_available(m)]
        if missing:
            hint = getattr(factory, "install_hint", None) or f"pip install {' '.join(missing)}"
            packages = ", ".join(f"'{m}'" for m in missing)
            issues.append(ConfigIssue(key, f"the {name} backend needs the {packages} package, which is not "
                                           f"installed; install it with `{hint}`"))
        schema = getattr(factory, "settings_schema", None)
        parsed = validate_dataclass(schema, values, settings_key, issues) if schema is not None else values
        if not missing and parsed is not None:
            specs.append(BackendSpec(name, key, factory, parsed))
    return specs, issues
