"""Expert parallelism (``distributed.ep_size``): not implemented; validation refuses it rather than ignore it."""

from __future__ import annotations

from typing import Any

from automodel.errors import ConfigIssue


def ep_issues(ep_size: Any, section: str = "distributed") -> list[ConfigIssue]:
    """``ep_size`` 1 or unset (upstream writes ``null``) runs every expert on every rank; more is refused."""
    if ep_size is None or ep_size == 1 and not isinstance(ep_size, bool):
        return []
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        return [ConfigIssue(f"{section}.ep_size", f"must be a positive integer or null, found {ep_size!r}")]
    return [ConfigIssue(f"{section}.ep_size", f"{ep_size}: expert parallelism (experts of a mixture-of-experts model "
                        "spread over ranks) is not supported here; set ep_size: 1 (every rank holds every expert; "
                        "FSDP2 shards them over the data-parallel ranks) or null")]
