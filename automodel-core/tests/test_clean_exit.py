"""A finished two-process run hands interpreter shutdown no process-group thread to race.

``destroy_process_group`` only unregisters the groups; gloo's worker and transport threads live until the group
objects die. When that happens during interpreter finalization a worker can die in std::terminate ("terminate called
without an active exception", a nonzero exit), rarely and more often the busier the machine. So this test checks
the cause rather than waiting for the symptom: the native threads still alive in each rank's last atexit hook, and
that a rank then exits without the interpreter's finalization (where the threads a DTensor run's groups keep on
torch's C++ side would end).

The hook comes from a recipe of this test's own (a plugin distribution written to tmp_path, the toy recipe that
registers it in ``setup``, before the engine registers its own exit work, so it runs after that work).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from automodel.testing import free_port, run_cli, toy_config, write_dist, write_yaml

THREAD_REPORTING_RECIPE = '''
import atexit
import os
from pathlib import Path

from automodel.testing.toy import ToyRecipe


def record_threads(path):
    tasks = Path("/proc/self/task")
    path.write_text("\\n".join((task / "comm").read_text().strip() for task in tasks.iterdir()))


class Finalized:
    """Writes its file when interpreter finalization clears the module holding it."""

    def __init__(self, path):
        self.path = path

    def __del__(self):
        self.path.write_text("finalized")


KEPT = []


class ThreadReportingToy(ToyRecipe):
    """The toy run; at exit, the names of this rank's native threads go to threads-<rank>.txt; finalized-<rank>.txt
    is written if the interpreter's finalization runs."""

    def setup(self):
        atexit.register(record_threads, Path(f"threads-{os.environ['RANK']}.txt").resolve())
        KEPT.append(Finalized(Path(f"finalized-{os.environ['RANK']}.txt").resolve()))
        super().setup()
'''

PLUGIN = '''
from automodel import hookimpl


@hookimpl
def automodel_allowed_targets():
    return ["exit_probe"]
'''


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through Linux's /proc")
def test_a_two_process_run_leaves_no_gloo_thread_to_interpreter_shutdown(tmp_path):
    dist = write_dist(tmp_path / "dist", "exit-probe", "0.1", {"exit_probe": "exit_probe.plugin"},
                      {"exit_probe/__init__.py": "", "exit_probe/recipe.py": THREAD_REPORTING_RECIPE,
                       "exit_probe/plugin.py": PLUGIN})
    config = write_yaml(tmp_path / "toy.yaml", toy_config(
        tmp_path / "ckpt", recipe={"_target_": "exit_probe.recipe.ThreadReportingToy"},
        step_scheduler={"max_steps": 2}))
    pythonpath = os.pathsep.join(filter(None, [str(dist), os.environ.get("PYTHONPATH")]))
    result = run_cli("run", "-c", config, "--nproc-per-node", "2", "--master-port", free_port(), cwd=tmp_path,
                     PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        threads = (tmp_path / f"threads-{rank}.txt").read_text().split()
        assert threads and not [name for name in threads if "gloo" in name], (rank, threads)
        # the exit handlers ran, then the rank exited without finalization: torch keeps a DTensor run's default
        # group (FSDP2, tp) on its C++ side, whose threads finalization could end mid C++ (std::terminate)
        assert not (tmp_path / f"finalized-{rank}.txt").exists(), rank
