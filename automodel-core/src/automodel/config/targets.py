"""Resolving ``_target_`` strings to callables, behind the registry of what installed distributions registered.

A target resolves only when the registry admits it (:mod:`automodel.config.registry`): a callable registered
exactly (or a ``from_*`` constructor of a class registered exactly), or a name under a distribution's own package
or under a name the person running trusts (:mod:`automodel.config.trust`). Then the lookup itself is checked: every
module it passes through must be the module its path names (``torch.os`` is the module ``os``, so
``torch.os.system`` never resolves), and the callable's defining module must not be denied and, for a name admitted
by prefix, must itself be registered by prefix, or the callable's own location must be (so a trusted package's
``from subprocess import run`` does not make ``subprocess.run`` a target, while ``automodel_llm.peft.PeftConfig``
may stand for the registered ``automodel.hf.PeftConfig``). The deny-list
(:data:`automodel.config.registry.DENIED`) applies to every name, whoever registered or trusted it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from automodel.config.core_targets import CORE_TARGETS
from automodel.config.registry import (
    CONSTRUCTOR,
    DENIED,
    DOTTED,
    HF_CONFIG_MODULE,
    HF_CONFIG_RULE,
    PREFIX,
    RULE,
    Grant,
    Registration,
    TargetRegistry,
    classify,
    under,
)
from automodel.config.trust import ALLOW_ENV, ALLOW_FLAG, UserTrust, trusted_targets_file
from automodel.suggest import did_you_mean

# upstream's file form of a target in its own package (its loader imports the file): ``nemo_automodel/x/y.py:Name``
UPSTREAM_FILE = re.compile(r"(?P<module>nemo_automodel(?:/[A-Za-z][A-Za-z0-9_]*)+)\.py:(?P<name>[A-Za-z][A-Za-z0-9_]*)")


class TargetError(Exception):
    """A target that cannot or may not be resolved; the message is for the user."""

    def __init__(self, message: str, suggestion: str | None = None):
        super().__init__(message)
        self.suggestion = suggestion


def core_registry() -> TargetRegistry:
    """The core's own registrations (what the core plugin registers through ``automodel_allowed_targets``)."""
    return TargetRegistry(classify(CORE_TARGETS, {"automodel"}, "automodel-core")[0])


def how_to_trust(name: str) -> str:
    return (f"if it is your own code and you trust it, pass {ALLOW_FLAG} {name}, set {ALLOW_ENV}={name} or add "
            f"it as a line to {trusted_targets_file()}")


@dataclass(frozen=True)
class InstalledRecipes:
    """What a config's ``recipe:`` may name: each installed route's recipe (by its dotted path) and the names the
    domains registered for a route (``aliases.recipe``: upstream's recipe class names and paths)."""

    paths: Mapping[str, str] = field(default_factory=dict)  # a name -> the recipe's dotted path
    routes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # a recipe's dotted path -> its routes

    def describe(self) -> str:
        if not self.routes:
            return "no recipes are installed; install a domain such as automodel-llm"
        lines = []
        for path, routes in sorted(self.routes.items(), key=lambda item: item[1]):
            names = sorted(n for n, p in self.paths.items() if p == path and n != path and "." not in n)
            also = f"; also named {', '.join(names)}" if names else ""
            lines.append(f"{' / '.join(routes)}: {path}{also}")
        return "the installed recipes are " + " | ".join(lines)


class TargetResolver:
    """Resolves target strings; aliases map short or upstream names to registered dotted paths.

    ``registry`` defaults to the core's registrations; ``trust`` (default: this process's, see
    :meth:`UserTrust.current`) adds the person running's trusted names as prefixes; ``unsupported`` maps names
    that a distribution knows and does not implement to the reason they are refused; ``recipes`` are the names a
    config's ``recipe:`` may give (:meth:`resolve_recipe`).
    """

    def __init__(self, registry: TargetRegistry | None = None, aliases: Mapping[str, str] | None = None,
                 trust: UserTrust | None = None, unsupported: Mapping[str, str] | None = None,
                 recipes: InstalledRecipes | None = None):
        self.trust = trust if trust is not None else UserTrust.current()
        base = registry if registry is not None else core_registry()
        self.registry = base.extended(Registration(t.name, PREFIX, t.source) for t in self.trust.names)
        self.aliases = dict(aliases or {})
        self.unsupported = dict(unsupported or {})
        self.recipes = recipes if recipes is not None else InstalledRecipes()
        self._cache: dict[str, Callable] = {}

    def resolve_recipe(self, name: Any) -> type:
        """The recipe class a config's ``recipe:`` names: an installed route's recipe (by a registered recipe name
        or its dotted path), else a registered target that is a class (a recipe of your own, trusted)."""
        path = self.recipes.paths.get(name, name) if isinstance(name, str) else name
        try:
            cls = self.resolve(path)
        except TargetError as err:
            # an unsupported name's reason says what to use instead; a dotted path's error says why it did not resolve
            known = isinstance(name, str) and ("." in name or name in self.unsupported)
            reason = f" ({self.unsupported[name] if name in self.unsupported else err})" if known else ""
            raise TargetError(f"'{name}' names no recipe installed here{reason}; {self.recipes.describe()}; or run "
                              "a route directly: automodel <command> <domain> -c FILE") from None
        if not isinstance(cls, type):
            raise TargetError(f"'{name}' is not a recipe class; {self.recipes.describe()}")
        return cls

    def expand(self, name: str) -> str:
        """The dotted path an alias stands for (or the name itself); upstream's file form of one of its own
        callables (``nemo_automodel/components/x.py:Name``, which its loader imports from the file) stands for the
        alias of its dotted name where there is one: no file is read."""
        name = self.upstream_dotted(name)
        seen = set()
        while name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        return name

    def upstream_dotted(self, name: str) -> str:
        """``nemo_automodel/a/b.py:Name`` as ``nemo_automodel.a.b.Name`` when that is an alias or an unsupported
        name here; any other name as it is."""
        match = UPSTREAM_FILE.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            return name
        dotted = match["module"].replace("/", ".") + "." + match["name"]
        return dotted if dotted in self.aliases or dotted in self.unsupported else name

    def check_unread(self, name: Any) -> None:
        """Raise TargetError for a target in a section nothing reads that is dangerous anywhere: not a dotted path,
        private, or able to run arbitrary code. Whether it is registered does not matter there (nothing calls it:
        upstream sets sections aside with a ``_`` prefix, targets and all). Imports nothing."""
        if not isinstance(name, str) or not name:
            raise TargetError(f"_target_ must be a dotted path string, found {name!r}")
        self._check_path(self.expand(name), original=name, registered=False)

    def resolve(self, name: Any) -> Callable:
        if not isinstance(name, str) or not name:
            raise TargetError(f"_target_ must be a dotted path string, found {name!r}")
        if name in self._cache:
            return self._cache[name]
        reason = self.unsupported.get(self.upstream_dotted(name))
        if reason is not None:
            raise TargetError(f"'{name}' is not supported here: {reason}")
        path = self.expand(name)
        grant = self._check_path(path, original=name)
        obj = self._import(path, grant)
        if _hf_config_reader(obj):
            obj = functools.partial(read_hf_config, obj.__self__)
        self._cache[name] = obj
        return obj

    def _check_path(self, path: str, original: str, registered: bool = True) -> Grant | None:
        if "/" in path or "\\" in path or ":" in path or path.endswith(".py"):
            raise TargetError(f"'{original}' looks like a file path; a target must be an importable dotted path "
                              "such as torch.optim.AdamW")
        if any(part.startswith("_") for part in path.split(".")):
            raise TargetError(f"'{original}' names a private attribute (a part starting with '_'); only public "
                              "callables may be targets")
        if not DOTTED.match(path):
            raise TargetError(f"'{original}' is not a dotted Python path such as torch.optim.AdamW")
        if under(path, DENIED):
            raise TargetError(f"'{original}' is refused: it can execute arbitrary code or reach the operating system")
        if not registered:
            return None
        grant = self.registry.grant(path)
        if grant is None:
            shown = original if original == path else f"{original}' (alias of '{path}"
            raise TargetError(f"'{shown}' is not a registered target: a config may name only callables that an "
                              "installed distribution registered (`automodel targets` lists them) or that you "
                              f"trust; {how_to_trust(path)}",
                              did_you_mean(original, [*self.aliases, *self.registry.exact_names()]))
        return grant

    def _import(self, path: str, grant: Grant) -> Callable:
        parts = path.split(".")
        try:
            obj: Any = importlib.import_module(parts[0])
        except ModuleNotFoundError as err:
            if err.name == parts[0]:
                raise TargetError(f"cannot import '{parts[0]}' (from '{path}'): no such module is installed") from None
            raise TargetError(f"importing '{parts[0]}' failed: {err}") from None
        for i, part in enumerate(parts[1:], start=1):
            if isinstance(obj, types.ModuleType):
                self._check_module(obj, ".".join(parts[:i]), path)
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            if isinstance(obj, types.ModuleType):
                submodule = ".".join(parts[: i + 1])
                try:
                    obj = importlib.import_module(submodule)
                    continue
                except ModuleNotFoundError as err:
                    if err.name != submodule:
                        raise TargetError(f"importing '{submodule}' failed: {err}") from None
                except ImportError as err:
                    raise TargetError(f"importing '{submodule}' failed: {err}") from None
            public = [n for n in dir(obj) if not n.startswith("_")]
            owner = ".".join(parts[:i])
            suggestion = did_you_mean(part, public)
            raise TargetError(f"'{owner}' has no attribute '{part}'",
                              f"{owner}.{suggestion}" if suggestion else None)
        if isinstance(obj, types.ModuleType):
            raise TargetError(f"'{path}' is a module, not a callable; name a class or function inside it")
        if not callable(obj):
            raise TargetError(f"'{path}' is not callable (found {type(obj).__name__})")
        if grant.how == CONSTRUCTOR and not (inspect.ismethod(obj) and isinstance(obj.__self__, type)):
            raise TargetError(f"'{path}' is not a classmethod constructor of the registered class "
                              f"'{grant.registration.name}'")
        if grant.how == RULE and not (is_hf_config_class(obj) or _hf_config_reader(obj)):
            raise TargetError(f"'{path}' is not one of transformers' configuration classes (a PretrainedConfig "
                              "subclass defined in transformers.models.<model>.configuration_<model>), the only "
                              f"classes the rule '{HF_CONFIG_RULE}' admits")
        self._check_defining_module(obj, path, grant)
        return obj

    @staticmethod
    def _check_module(module: types.ModuleType, expected: str, path: str) -> None:
        """A module on the way must be the module its path names, never another one reached by attribute."""
        name = module.__name__
        if under(name, DENIED) or name != expected:
            raise TargetError(f"'{path}' is refused: '{expected}' is the module '{name}', which is not allowed")

    def _check_defining_module(self, obj: Any, path: str, grant: Grant) -> None:
        owner = obj.__self__ if inspect.ismethod(obj) else obj
        if inspect.ismethod(obj) and not isinstance(owner, type):
            owner = type(owner)
        module = getattr(owner, "__module__", None)
        if not isinstance(module, str):
            return
        qualname = getattr(owner, "__qualname__", None)
        location = f"{module}.{qualname}" if isinstance(qualname, str) else module
        if under(module, DENIED) or under(location, DENIED):
            raise TargetError(f"'{path}' is refused: it is {location}, which can execute arbitrary code")
        registered = self.registry.prefixes()
        if grant.how == PREFIX and not (under(module, registered) or under(location, registered)):
            raise TargetError(f"'{path}' is refused: it is defined in module '{module}', which is not registered "
                              f"(a name under '{grant.registration.name}' re-exported from elsewhere)")


def is_hf_config_class(obj: Any) -> bool:
    """A class defined in a transformers configuration module that derives from transformers' ``PretrainedConfig``
    (named ``PreTrainedConfig`` in transformers 5): a data class of hyperparameters, whatever name reached it. Its
    constructor takes any key (stored on the configuration, as from a ``config.json``; transformers converts its
    legacy names, ``rope_theta`` into ``rope_parameters``), though its signature lists only the declared fields."""
    return (isinstance(obj, type) and HF_CONFIG_MODULE.fullmatch(obj.__module__) is not None
            and any(base.__module__ == "transformers.configuration_utils"
                    and base.__name__ in ("PretrainedConfig", "PreTrainedConfig") for base in obj.__mro__))


def _hf_config_reader(obj: Any) -> bool:
    """``from_pretrained`` of one of transformers' configuration classes (reads a ``config.json``)."""
    return inspect.ismethod(obj) and obj.__name__ == "from_pretrained" and is_hf_config_class(obj.__self__)


def read_hf_config(cls: type, pretrained_model_name_or_path: str, **keys: Any) -> Any:
    """``cls.from_pretrained`` with the node's keys, each kept: the ones the class does not declare are set on the
    configuration as a ``config.json``'s are (transformers' ``from_pretrained`` drops them), so no key of the node
    goes unread."""
    config, unused = cls.from_pretrained(pretrained_model_name_or_path, return_unused_kwargs=True, **keys)
    for key, value in unused.items():
        setattr(config, key, value)
    return config
