"""A rank that stalls ends the run after ``dist_env.timeout_minutes`` with an error naming the step, not a hang.

The stall comes from a recipe of this test's own (a plugin distribution written to tmp_path, the toy recipe with a
``compute_loss`` that sleeps on rank 1 at step 2): nothing in the product can be made to stall on purpose.
"""

from __future__ import annotations

from automodel.testing import free_port, run_cli, toy_config, write_dist, write_yaml

STALLING_RECIPE = '''
import time

import torch.distributed as dist

from automodel.testing.toy import ToyRecipe


class StallingToy(ToyRecipe):
    """Rank 1 stops answering in step 2 (for far longer than the test's collective timeout of 3 s)."""

    def compute_loss(self, model, batch):
        if dist.get_rank() == 1 and self.step_scheduler.step + 1 == 2:
            time.sleep(8)
        return super().compute_loss(model, batch)
'''

PLUGIN = '''
from automodel import hookimpl


@hookimpl
def automodel_register_routes(routes):
    routes.add("stall", "toy", recipe="stall_toy.recipe.StallingToy", help="a toy run whose rank 1 stalls")


@hookimpl
def automodel_allowed_targets():
    return ["automodel.testing"]
'''


def test_a_stalled_rank_ends_the_run_with_the_step_named(tmp_path):
    dist = write_dist(tmp_path / "dist", "stall-toy", "0.1", {"stall": "stall_toy.plugin"},
                      {"stall_toy/__init__.py": "", "stall_toy/recipe.py": STALLING_RECIPE,
                       "stall_toy/plugin.py": PLUGIN})
    config = write_yaml(tmp_path / "toy.yaml", toy_config(tmp_path / "ckpt", recipe=None, dist_env={
        "timeout_minutes": 0.05}, distributed={"strategy": "fsdp2"}))
    result = run_cli("stall", "toy", "-c", config, "--nproc-per-node", "2", "--master-port", free_port(),
                     cwd=tmp_path, timeout=240, PYTHONPATH=str(dist), OMP_NUM_THREADS="1")
    assert result.returncode != 0
    assert "error: step 2: a collective across the 2 ranks did not complete" in result.stderr, result.stderr[-3000:]
    assert "dist_env.timeout_minutes (0.05)" in result.stderr
