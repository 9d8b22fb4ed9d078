"""BaseRecipe: the unit a route runs. Importing this module imports no torch."""

from __future__ import annotations

from typing import Any, ClassVar

from automodel.config.node import Config
from automodel.config.specs import Metadata, RecipeRef
from automodel.config.targets import TargetError
from automodel.errors import ConfigIssue

_LAUNCHER = ("upstream's CLI submits the job through {name} with it; automodel launches here, with torchrun "
             "(--nproc-per-node, --nnodes), or writes a Slurm script (slurm:)")


class BaseRecipe:
    """A recipe builds every component from its config in ``setup()`` and trains in ``run_train_validation_loop()``.

    ``sections`` declares the top-level YAML sections the recipe reads, ``stateful`` the attributes a checkpoint
    saves and restores (objects with ``state_dict``/``load_state_dict``); both are merged along the class
    hierarchy, so a subclass lists only what it adds.
    """

    # The recipe class receives the config itself (``cfg``), never keyword arguments from the YAML.
    sections: ClassVar[dict[str, Any]] = {
        "recipe": RecipeRef("the recipe `automodel run` runs: a name an installed domain registered for its route "
                            "(upstream's recipe class names), the recipe's dotted path, or {_target_: ...}"),
        "ci": Metadata("upstream's CI settings, which its CI tooling reads"),
        "skypilot": Metadata(_LAUNCHER.format(name="SkyPilot")),
        "nemo_run": Metadata(_LAUNCHER.format(name="NeMo-Run")),
    }
    stateful: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @classmethod
    def merged(cls, attribute: str) -> dict[str, Any]:
        """A dict class attribute merged along the class hierarchy (a subclass's entries win)."""
        merged: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            merged.update(klass.__dict__.get(attribute, {}))
        return merged

    @classmethod
    def all_sections(cls) -> dict[str, Any]:
        return cls.merged("sections")

    @classmethod
    def all_stateful(cls) -> tuple[str, ...]:
        """The declared stateful attribute names of the whole class hierarchy, base classes first."""
        names: dict[str, None] = {}
        for klass in reversed(cls.__mro__):
            names.update(dict.fromkeys(klass.__dict__.get("stateful", ())))
        return tuple(names)

    def stateful_attributes(self) -> dict[str, Any]:
        """Name -> object for everything a checkpoint must save to resume exactly (declared and already built)."""
        return {name: value for name in self.all_stateful() if (value := getattr(self, name, None)) is not None}

    @classmethod
    def own_world(cls, data: dict, nodes: int = 1) -> tuple[int, int]:
        """``(processes, nodes)``: the smallest launch the config's own layout needs (``data``: the config as
        written, overrides applied and references resolved). ``automodel validate`` checks a config for it when
        it is given no launch to check against (no --nproc-per-node / --nnodes, no WORLD_SIZE). A recipe without
        a parallel layout runs in one process."""
        return 1, nodes

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        """Recipe-level checks across sections (batch arithmetic, say); sections that failed to validate are None."""
        return cls.recipe_issues(cfg)

    @classmethod
    def recipe_issues(cls, cfg: Config) -> list[ConfigIssue]:
        """A config's ``recipe:`` must name a recipe, and one this recipe is (a route runs its own recipe)."""
        node = cfg.get("recipe")
        if node is None:
            return []
        try:
            named = cfg.resolver.resolve_recipe(node.target)
        except TargetError:  # reported by the section's own check already
            return []
        if not issubclass(named, BaseRecipe):
            return [ConfigIssue("recipe", f"'{node.target}' is {named.__module__}.{named.__qualname__}, not a recipe "
                                          "(a subclass of automodel.BaseRecipe)")]
        if not issubclass(cls, named):
            return [ConfigIssue("recipe", f"'{node.target}' is {named.__module__}.{named.__qualname__}, but this "
                                          f"command runs {cls.__module__}.{cls.__qualname__}: run the config with "
                                          "`automodel run -c FILE` (it runs the recipe the config names), or "
                                          "remove `recipe:`")]
        return []

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        """Lines printed by ``--dry-run``: what the recipe would build and do."""
        return [f"recipe: {cls.__module__}.{cls.__qualname__}", f"sections: {', '.join(cfg.section_names())}"]

    def setup(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement setup()")

    def run_train_validation_loop(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement run_train_validation_loop()")
