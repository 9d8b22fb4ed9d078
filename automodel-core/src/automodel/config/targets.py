"""Resolving ``_target_`` strings to callables, behind an allow-list.

A target is a dotted path to a public callable inside an allowed top-level package. The allow-list is checked
on the *string* and again on every module the lookup passes through and on the module the callable was defined
in, so ``torch.os.system`` or a function re-exported from ``subprocess`` never resolves even though ``torch``
is allowed. Some callables inside allowed packages run arbitrary code (``torch.load`` unpickles) and are refused
always, whatever the allow-list says.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from automodel.suggest import did_you_mean

CORE_PREFIXES = ("automodel", "torch", "transformers", "peft", "datasets", "torchdata", "safetensors")

# Never resolvable, even when a user's AUTOMODEL_ALLOW_TARGETS names them: they execute code or reach the OS.
DENIED_PREFIXES = (
    "os", "posix", "nt", "sys", "subprocess", "builtins", "importlib", "pickle", "_pickle", "marshal", "shutil",
    "runpy", "ctypes", "socket", "pty", "code", "codeop", "shelve", "dill", "cloudpickle", "multiprocessing",
    "signal", "threading", "asyncio", "pathlib", "io", "tempfile", "webbrowser", "http", "urllib", "requests",
    "torch.load", "torch.serialization", "torch.hub", "torch.jit.load", "torch.jit._serialization", "torch.package",
    "torch.utils.cpp_extension", "torch.ops", "torch.library", "torch.distributed.rpc", "torch.compiler",
    "torch.utils.model_zoo", "numpy.load", "datasets.load_from_disk",
    "transformers.dynamic_module_utils", "torch._dynamo", "torch.fx",
    # run shell commands or launch scripts / binaries named by their arguments
    "torch.utils.collect_env", "torch.distributed.run", "torch.distributed.launch", "torch.distributed.launcher",
    "torch.distributed.elastic", "torch.backends.xeon", "torch.utils.benchmark",
    # unpickle files named by their arguments
    "torch.export.load", "torch.export.pt2_archive", "torch.distributed.checkpoint",
    "transformers.modeling_utils.load_state_dict", "peft.utils.save_and_load.torch_load",
    # load shared libraries named by their arguments
    "torch.classes", "torch.cuda.memory.CUDAPluggableAllocator",
)

ALLOW_ENV = "AUTOMODEL_ALLOW_TARGETS"
_DOTTED = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*$")


class TargetError(Exception):
    """A target that cannot or may not be resolved; the message is for the user."""

    def __init__(self, message: str, suggestion: str | None = None):
        super().__init__(message)
        self.suggestion = suggestion


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def user_allowed_prefixes() -> tuple[str, ...]:
    return tuple(p.strip() for p in os.environ.get(ALLOW_ENV, "").split(",") if p.strip())


class TargetResolver:
    """Resolves target strings; aliases map short or upstream names to dotted paths of our own."""

    def __init__(self, allowed_prefixes: Iterable[str] = CORE_PREFIXES, aliases: Mapping[str, str] | None = None):
        self.allowed = tuple(dict.fromkeys([*allowed_prefixes, *user_allowed_prefixes()]))
        self.aliases = dict(aliases or {})
        self._cache: dict[str, Callable] = {}

    def expand(self, name: str) -> str:
        """The dotted path an alias stands for (or the name itself)."""
        seen = set()
        while name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        return name

    def resolve(self, name: Any) -> Callable:
        if not isinstance(name, str) or not name:
            raise TargetError(f"_target_ must be a dotted path string, found {name!r}")
        if name in self._cache:
            return self._cache[name]
        path = self.expand(name)
        self._check_path(path, original=name)
        obj = self._import(path)
        self._cache[name] = obj
        return obj

    def _check_path(self, path: str, original: str) -> None:
        if "/" in path or "\\" in path or ":" in path or path.endswith(".py"):
            raise TargetError(f"'{original}' looks like a file path; a target must be an importable dotted path "
                              "such as torch.optim.AdamW")
        if any(part.startswith("_") for part in path.split(".")):
            raise TargetError(f"'{original}' names a private attribute (a part starting with '_'); only public "
                              "callables may be targets")
        if not _DOTTED.match(path):
            raise TargetError(f"'{original}' is not a dotted Python path such as torch.optim.AdamW")
        if _under(path, DENIED_PREFIXES):
            raise TargetError(f"'{original}' is refused: it can execute arbitrary code or reach the operating system")
        if not _under(path, self.allowed):
            known = ", ".join(self.allowed)
            raise TargetError(f"'{original}' is not under an allowed module prefix ({known}); to allow your own "
                              f"package set {ALLOW_ENV}=yourpkg",
                              did_you_mean(original, self.aliases))

    def _check_module(self, module: types.ModuleType, path: str) -> None:
        name = module.__name__
        if _under(name, DENIED_PREFIXES) or not _under(name, self.allowed):
            raise TargetError(f"'{path}' is refused: it reaches module '{name}', which is not allowed")

    def _import(self, path: str) -> Callable:
        parts = path.split(".")
        try:
            obj: Any = importlib.import_module(parts[0])
        except ModuleNotFoundError as err:
            if err.name == parts[0]:
                raise TargetError(f"cannot import '{parts[0]}' (from '{path}'): no such module is installed") from None
            raise TargetError(f"importing '{parts[0]}' failed: {err}") from None
        for i, part in enumerate(parts[1:], start=1):
            if isinstance(obj, types.ModuleType):
                self._check_module(obj, path)
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
        self._check_defining_module(obj, path)
        return obj

    def _check_defining_module(self, obj: Any, path: str) -> None:
        owner = obj.__self__ if inspect.ismethod(obj) else obj
        if inspect.ismethod(obj) and not isinstance(owner, type):
            owner = type(owner)
        module = getattr(owner, "__module__", None)
        if not isinstance(module, str):
            return
        if _under(module, DENIED_PREFIXES) or not _under(module, self.allowed):
            raise TargetError(f"'{path}' is refused: it is defined in module '{module}', which is not allowed")
        # A denied callable re-exported under another public name (torch.cuda.CUDAPluggableAllocator).
        qualname = getattr(getattr(obj, "__func__", obj), "__qualname__", None)
        if isinstance(qualname, str) and _under(f"{module}.{qualname}", DENIED_PREFIXES):
            raise TargetError(f"'{path}' is refused: it is {module}.{qualname}, which can execute arbitrary code")
