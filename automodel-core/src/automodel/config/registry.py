"""The registry of what a config may name in ``_target_``: exact callables, or a distribution's own package.

Each installed distribution registers, by dotted string (nothing is imported), the callables its configs build:

* an **exact** name: that callable; when it is a class, also its public ``from_*`` classmethods (its documented
  constructors), so ``transformers.AutoTokenizer`` admits ``transformers.AutoTokenizer.from_pretrained``;
* a **prefix**: everything under one of the distribution's *own* top-level packages (``automodel_llm``). A prefix
  naming another library's package is refused at registration, because every large library holds callables
  that run commands, import files or unpickle.
* the **rule** :data:`HF_CONFIG_RULE`: the constructor of any of transformers' own configuration classes (a
  ``PretrainedConfig`` subclass defined in ``transformers.models.<model>.configuration_<model>``, by that path or
  its ``transformers.<Name>Config`` re-export) and its ``from_pretrained`` (which reads a ``config.json``, and
  nothing else: a concrete class never loads a model's own code), never anything else: they are data classes of a
  model's hyperparameters, and upstream's configs build ``model.config`` with them. The resolver checks what the
  name imports to (:meth:`automodel.config.targets.TargetResolver.resolve`).

What the person running trusts (:mod:`automodel.config.trust`) is added as prefixes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import PurePosixPath

EXACT, PREFIX, RULE = "exact", "prefix", "rule"
HF_CONFIG_RULE = "transformers.models.<model>.configuration_<model>.<Name>Config"
# what HF_CONFIG_RULE admits by name: the class in its configuration module, or its re-export at the top level
HF_CONFIG_PATH = re.compile(
    r"transformers\.(models\.[a-z0-9_]+\.configuration_[a-z0-9_]+\.)?[A-Z][A-Za-z0-9]*Config(\.from_pretrained)?")
HF_CONFIG_MODULE = re.compile(r"transformers\.models\.[a-z0-9_]+\.configuration_[a-z0-9_]+")

# Never resolvable, whoever registers or trusts them: they execute code, reach the operating system or unpickle.
# Registration by exact callable is the boundary; this list is defense in depth for names trusted by prefix.
DENIED = (
    "os", "posix", "nt", "sys", "subprocess", "builtins", "importlib", "pickle", "_pickle", "marshal", "shutil",
    "runpy", "ctypes", "socket", "pty", "code", "codeop", "shelve", "dill", "cloudpickle", "multiprocessing",
    "signal", "threading", "asyncio", "pathlib", "io", "tempfile", "webbrowser", "http", "urllib", "requests",
    "torch.load", "torch.serialization", "torch.hub", "torch.jit.load", "torch.jit._serialization", "torch.package",
    "torch.utils.cpp_extension", "torch.ops", "torch.library", "torch.distributed.rpc", "torch.compiler",
    "torch.utils.model_zoo", "numpy.load", "datasets.load_from_disk", "datasets.Dataset.load_from_disk",
    "datasets.DatasetDict.load_from_disk", "transformers.dynamic_module_utils", "torch._dynamo", "torch.fx",
    # run shell commands, import files or launch scripts / binaries named by their arguments
    "torch.utils.collect_env", "torch.distributed.run", "torch.distributed.launch", "torch.distributed.launcher",
    "torch.distributed.elastic", "torch.backends.xeon", "torch.utils.benchmark", "transformers.testing_utils",
    "transformers.utils.import_utils", "transformers.commands",
    # unpickle files or bytes named by their arguments
    "torch.export.load", "torch.export.pt2_archive", "torch.distributed.checkpoint", "torch.utils.model_dump",
    "torch.utils.data.datapipes", "torch.distributed.flight_recorder", "transformers.modeling_utils.load_state_dict",
    "peft.utils.save_and_load.torch_load",
    # load shared libraries named by their arguments
    "torch.classes", "torch.cuda.memory.CUDAPluggableAllocator",
    # the core's own: the CLI runs commands (a nested one with its own trust flags); test helpers write plugin
    # distributions and files, or start the CLI with an environment of the caller's choosing
    "automodel.cli", "automodel.testing.run_cli", "automodel.testing.write_dist", "automodel.testing.write_yaml",
)
CONSTRUCTOR = "constructor"  # a public from_* classmethod of a class registered exactly

DOTTED = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class Registration:
    name: str
    kind: str  # EXACT, PREFIX or RULE
    source: str  # the distribution that registered it, or where the person running trusted it


@dataclass(frozen=True)
class Grant:
    """Why a dotted path may be resolved: the registration that admits it, and how (exact, constructor, prefix,
    rule)."""

    registration: Registration
    how: str


def under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class TargetRegistry:
    """Registrations by name; a name registered by several distributions keeps each source."""

    def __init__(self, registrations: Iterable[Registration] = ()):
        self._entries: dict[tuple[str, str], list[Registration]] = {}
        for registration in registrations:
            self.add(registration)

    def add(self, registration: Registration) -> None:
        sources = self._entries.setdefault((registration.name, registration.kind), [])
        if registration not in sources:
            sources.append(registration)

    def extended(self, registrations: Iterable[Registration]) -> TargetRegistry:
        """A copy with more registrations (the person running's trusted names)."""
        return TargetRegistry([*self.entries(), *registrations])

    def entries(self) -> list[Registration]:
        return [r for sources in self._entries.values() for r in sources]

    def exact_names(self) -> list[str]:
        return [name for name, kind in self._entries if kind == EXACT]

    def prefixes(self) -> list[str]:
        return [name for name, kind in self._entries if kind == PREFIX]

    def grant(self, path: str) -> Grant | None:
        """The registration that admits ``path`` (by its string alone; the resolver checks the object after)."""
        if (path, EXACT) in self._entries:
            return Grant(self._entries[(path, EXACT)][0], EXACT)
        owner, _, last = path.rpartition(".")
        if last.startswith("from_") and (owner, EXACT) in self._entries:
            return Grant(self._entries[(owner, EXACT)][0], CONSTRUCTOR)
        if (HF_CONFIG_RULE, RULE) in self._entries and HF_CONFIG_PATH.fullmatch(path):
            return Grant(self._entries[(HF_CONFIG_RULE, RULE)][0], RULE)
        matching = [p for p in self.prefixes() if under(path, [p])]
        if matching:
            return Grant(self._entries[(max(matching, key=len), PREFIX)][0], PREFIX)
        return None


def distribution_packages(distribution: str) -> set[str]:
    """The top-level import packages an installed distribution ships (from its metadata; nothing is imported)."""
    try:
        dist = metadata.distribution(distribution)
    except (metadata.PackageNotFoundError, ValueError):
        return set()
    listed = dist.read_text("top_level.txt")
    if listed:
        return set(listed.split())
    packages = set()
    for file in dist.files or []:
        parts = PurePosixPath(str(file)).parts
        if len(parts) > 1 and parts[0].isidentifier():
            packages.add(parts[0])
        elif len(parts) == 1 and parts[0].endswith(".py") and not parts[0].startswith("__editable__"):
            packages.add(parts[0].removesuffix(".py"))
    return packages


def classify(names: Iterable[str], owned: set[str], source: str) -> tuple[list[Registration], list[str]]:
    """A plugin's ``automodel_allowed_targets()`` answer as registrations, and the problems with it.

    A name inside one of the plugin's own packages (``owned``) is a prefix; :data:`HF_CONFIG_RULE` the rule; any
    other dotted name is an exact callable; a bare package name the plugin does not own is refused (a prefix may
    only be its own package).
    """
    registrations, problems = [], []
    for name in names:
        if name == HF_CONFIG_RULE:
            registrations.append(Registration(name, RULE, source))
        elif not isinstance(name, str) or not DOTTED.match(name) or any(p.startswith("_") for p in name.split(".")):
            problems.append(f"{name!r} is not a dotted path to a public callable or package")
        elif under(name, DENIED):
            problems.append(f"'{name}' is refused always: it can execute code, reach the operating system or unpickle")
        elif name.split(".")[0] in owned:
            registrations.append(Registration(name, PREFIX, source))
        elif "." not in name:
            mine = ", ".join(sorted(owned)) or "none found"
            problems.append(f"'{name}' is not a package of {source} (its packages: {mine}): a plugin may register "
                            "only its own package as a prefix; list the exact callables it needs instead")
        else:
            registrations.append(Registration(name, EXACT, source))
    return registrations, problems
