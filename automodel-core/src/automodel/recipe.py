"""BaseRecipe: the unit a route runs. Importing this module imports no torch."""

from __future__ import annotations

from typing import Any, ClassVar

from automodel.config.node import Config
from automodel.config.schema import Target
from automodel.errors import ConfigIssue


class BaseRecipe:
    """A recipe builds every component from its config in ``setup()`` and trains in ``run_train_validation_loop()``.

    ``sections`` declares the top-level YAML sections the recipe reads (merged along the class hierarchy); any
    other section is a validation error. Attributes holding objects with ``state_dict``/``load_state_dict``
    (model, optimizer, schedulers, dataloader, RNG) are tracked automatically so checkpoints save them all.
    """

    # The recipe class receives the config itself (``cfg``), never keyword arguments from the YAML.
    sections: ClassVar[dict[str, Any]] = {
        "recipe": Target("the recipe class `automodel run` uses: {_target_: ...}", runtime_args=("cfg",)),
    }

    def __init__(self, cfg: Config):
        object.__setattr__(self, "_stateful", {})
        object.__setattr__(self, "_untracked", set())
        self.cfg = cfg

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name.startswith("_") or name in self._untracked:
            return
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            self._stateful[name] = value
        else:
            self._stateful.pop(name, None)

    def untrack(self, name: str) -> None:
        """Exclude an attribute from checkpoints (a frozen teacher model, say)."""
        self._untracked.add(name)
        self._stateful.pop(name, None)

    def stateful_attributes(self) -> dict[str, Any]:
        """Name -> object for everything a checkpoint must save to resume exactly."""
        return dict(self._stateful)

    @classmethod
    def all_sections(cls) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            merged.update(klass.__dict__.get("sections", {}))
        return merged

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        """Recipe-level checks across sections (batch arithmetic, say); sections that failed to validate are None."""
        return []

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        """Lines printed by ``--dry-run``: what the recipe would build and do."""
        return [f"recipe: {cls.__module__}.{cls.__qualname__}", f"sections: {', '.join(cfg.section_names())}"]

    def setup(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement setup()")

    def run_train_validation_loop(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement run_train_validation_loop()")
