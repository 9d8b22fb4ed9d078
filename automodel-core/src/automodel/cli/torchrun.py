"""torch's launcher (torchrun) for automodel's multi-process runs, with its failure told in one line.

When a rank stops with an error, that rank has already printed it (``error: model.dtype: ...``); torchrun then
stops the other ranks and raises ``ChildFailedError``, whose traceback through the launcher's own frames says
nothing more. Here that becomes one line naming the first rank that failed, and the exit status is that rank's
(2 for a config error, as in a single-process run).
"""

from __future__ import annotations

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
        print(f"error: rank {rank} stopped with exit status {failure.exitcode} (its message is above){others}",
              file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
