"""Slot ``context_parallel``: this build has no implementation, so ``distributed.cp_size > 1`` is refused at
validation and the slot never acts."""

from __future__ import annotations

from automodel.config import Config
from automodel.errors import ConfigIssue


def select(cfg: Config) -> tuple[str, str] | None:
    return None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    dist = cfg.distributed
    if dist is not None and dist.cp_size > 1:
        return [ConfigIssue("distributed.cp_size", f"{dist.cp_size}: context parallelism is not supported by this "
                                                   "build; use cp_size: 1")]
    return []
