"""Shared fixtures for the core's tests: a clean environment, importable target modules, tiny plugin dists."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from automodel.testing import write_dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_AUTOMODEL_ENV = ("AUTOMODEL_ALLOW_TARGETS", "AUTOMODEL_DISABLE_PLUGINS", "AUTOMODEL_DEBUG")

# A module of harmless callables that the tests allow as targets (prefix ``amt_targets``).
TARGETS_MODULE = '''
import os
from pathlib import Path
from subprocess import run as run_command   # re-exported from a denied module: must never resolve

system = os.system                           # re-exported from a denied module: must never resolve
CALLS = []


def make_thing(size: int, color: str = "red", marker: str | None = None):
    """A thing; ``marker`` (a path) is written when it is built, to prove that building happened."""
    if marker:
        Path(marker).write_text("built")
    CALLS.append(("make_thing", size, color))
    return {"size": size, "color": color}


def combine(left, right=None, items=()):
    CALLS.append(("combine",))
    return {"left": left, "right": right, "items": list(items)}


def anything(**kwargs):
    return kwargs


def touch(path: str):
    Path(path).write_text("touched")
    return path


def scaled_batch(batch, scale: float = 1.0, *, tag: str = "plain"):
    """A collate function with settings: the caller passes the batch, the config the rest."""
    CALLS.append(("scaled_batch", scale, tag))
    return {"items": list(batch), "scale": scale, "tag": tag}


class Collator:
    """A collator class: built once with the recipe's tokenizer and its settings, then called per batch."""

    def __init__(self, tokenizer, suffix: str = ""):
        CALLS.append(("Collator", tokenizer, suffix))
        self.tokenizer, self.suffix = tokenizer, suffix

    def __call__(self, batch):
        return {"items": list(batch), "by": f"{self.tokenizer}{self.suffix}"}


class ProcessorCollator:
    """A collator class built with the VLM recipe's processor (as upstream calls its VLM collate functions)."""

    def __init__(self, processor, max_length: int | None = None):
        self.processor, self.max_length = processor, max_length

    def __call__(self, batch):
        return {"items": list(batch), "by": self.processor, "max_length": self.max_length}


class Widget:
    def __init__(self, size: int = 1, *, name: str = "w"):
        self.size, self.name = size, name

    @classmethod
    def create(cls, size: int = 2):
        CALLS.append(("Widget.create", size))
        return cls(size, name="created")


NOT_CALLABLE = 42

from automodel import BaseRecipe


class TinyRecipe(BaseRecipe):
    """A recipe class: it takes the config (``cfg``), never keyword arguments from the YAML."""
'''


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """Every test starts without the user's automodel environment variables."""
    for name in _AUTOMODEL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))  # never the developer's trusted-targets
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def targets_dir(tmp_path_factory):
    """A directory on sys.path holding ``amt_targets`` (harmless callables)."""
    root = tmp_path_factory.mktemp("amt_targets_root")
    _write(root / "amt_targets.py", TARGETS_MODULE)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("amt_targets", None)


@pytest.fixture
def targets(targets_dir):
    """The imported ``amt_targets`` module, its call log emptied."""
    import amt_targets

    amt_targets.CALLS.clear()
    return amt_targets


@pytest.fixture
def make_resolver():
    """``make_resolver("pkg", aliases=...)``: a resolver over the core's registrations plus ``pkg`` by prefix (as
    if a test distribution registered its own package), with this process's user trust."""
    from automodel.config import Registration, TargetResolver, core_registry

    def make(*prefixes: str, aliases: dict[str, str] | None = None) -> TargetResolver:
        registry = core_registry().extended(Registration(p, "prefix", "amt-test") for p in prefixes)
        return TargetResolver(registry, aliases)

    return make


@pytest.fixture
def resolver(targets, make_resolver):
    return make_resolver("amt_targets", aliases={"Thing": "amt_targets.make_thing", "Chain": "Thing"})


@pytest.fixture
def make_dist(monkeypatch):
    """Create a dist under a fresh directory and put that directory on sys.path (entry points become visible)."""
    created: list[str] = []

    def make(root: Path, dist: str, version: str, entry_points: dict[str, str], files: dict[str, str]) -> Path:
        write_dist(root, dist, version, entry_points, {rel: textwrap.dedent(text) for rel, text in files.items()})
        monkeypatch.syspath_prepend(str(root))
        created.extend(Path(rel).parts[0].removesuffix(".py") for rel in files)
        return root

    yield make
    for name in list(sys.modules):
        if name.split(".")[0] in created:
            del sys.modules[name]


@pytest.fixture
def make_toy(tmp_path):
    """``make_toy(name="toy.yaml", **sections)``: a toy run's YAML (automodel.testing.toy_config) in tmp_path,
    checkpoints in tmp_path/ckpt."""
    from automodel.testing import toy_config, write_yaml

    def make(name: str = "toy.yaml", **sections) -> Path:
        return write_yaml(tmp_path / name, toy_config(tmp_path / "ckpt", **sections))

    return make


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """The distributed scenarios' results: one launch of two gloo ranks (see parallel_testing.run_all_scenarios),
    once for all workers."""
    from parallel_testing import run_all_scenarios

    from automodel.testing import once_per_session

    return once_per_session(tmp_path_factory, "two_ranks", run_all_scenarios)


@pytest.fixture(scope="session")
def model_parallel_ranks(tmp_path_factory):
    """The model-parallel scenarios' results and their single-process references (see
    parallel_testing.run_model_parallel_scenarios)."""
    from parallel_testing import run_model_parallel_scenarios

    return run_model_parallel_scenarios(tmp_path_factory)
