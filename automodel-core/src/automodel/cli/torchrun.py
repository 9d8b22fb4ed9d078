"""torch's launcher (torchrun) for automodel's multi-process runs, with its failure told in one line.

When a rank stops with an error, that rank has already printed it (``error: model.dtype: ...``); torchrun then
stops the other ranks and raises ``ChildFailedError``, whose traceback through the launcher's own frames says
nothing more. Here that becomes one line naming the first rank that failed, and the exit status is that rank's
(2 for a config error, as in a single-process run); a rank killed by a signal (which printed nothing) is named with
the signal and, for SIGKILL, its commonest cause.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        stopped = len(err.failures) - 1
        others = f"; the launcher stopped the other {stopped} rank(s)" if stopped else ""
        print(f"error: rank {rank} {how_it_stopped(failure.exitcode)}{others}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def how_it_stopped(exitcode: int) -> str:
    """What a rank's exit status says: an error it printed, or the signal that killed it (torchrun's negative
    status), SIGKILL with its commonest cause, the kernel's out-of-memory killer (the rank could print nothing)."""
    if exitcode >= 0:
        return f"stopped with exit status {exitcode} (its message is above)"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "an unknown signal"
    text = f"was killed by signal {-exitcode} ({name})"
    if -exitcode == signal.SIGKILL:
        text += (": it could print nothing; most often the kernel's out-of-memory killer ended it (the kernel log, "
                 "dmesg, says so): lower the batch size or the sequence length, or shard the model over more "
                 "processes")
    return text


if __name__ == "__main__":
    sys.exit(main())
