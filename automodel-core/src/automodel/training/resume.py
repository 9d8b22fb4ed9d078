"""Which checkpoint a run continues from, decided before anything is built (upstream's resume semantics).

* ``restore_from.path: <path or name>``: that checkpoint (an error when it is not one);
* ``restore_from.path: latest`` (any case): what ``LATEST`` names, or a fresh start with a note when there is no
  checkpoint yet (so a requeued job can always pass it);
* no ``restore_from``: a ``checkpoint_dir`` that already holds a run (a ``LATEST``) is continued from it, said on
  one line; a finished run is then reported complete and nothing is trained or re-saved.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from automodel.config import Config
from automodel.training.checkpoint import Checkpointer, CheckpointError
from automodel.training.context import BuildContext
from automodel.training.dist import any_rank
from automodel.training.trainer_state import read_trainer_state


def hold_checkpoint_dir(checkpointer: Checkpointer, ctx: BuildContext) -> None:
    """Rank 0 locks and tidies ``checkpoint_dir`` for the whole run; every rank stops if it cannot."""
    failure = None
    if ctx.is_main_process:
        try:
            checkpointer.prepare()
        except CheckpointError as err:
            failure = err
    if any_rank(failure is not None, ctx.device):
        checkpointer.release()
        raise failure or CheckpointError(f"rank 0 could not take checkpoint.checkpoint_dir '{checkpointer.root}' "
                                         "(see its error)")


def choose_checkpoint(cfg: Config, checkpointer: Checkpointer, log: Callable[[str], None]) -> Path | None:
    """The checkpoint this run resumes from (its trainer_state.json checked), or None to start fresh."""
    spec = cfg.restore_from.path if cfg.restore_from is not None else None
    if spec and spec.strip().lower() != "latest":
        chosen = checkpointer.resolve(spec)
    else:
        chosen = checkpointer.latest()
        if spec and chosen is None:
            log(f"note: restore_from.path: latest: no checkpoint under '{checkpointer.root}' yet; starting fresh")
        elif not spec and chosen is not None:
            log(f"resuming from {chosen}: checkpoint.checkpoint_dir already holds a run (its LATEST); to start "
                "fresh instead, choose a new checkpoint.checkpoint_dir")
    if chosen is not None:
        read_trainer_state(chosen)
    return chosen
