"""Batch arithmetic is checked when the config is validated, before anything is built (DESIGN §6), on the toy
recipe (its configs name it with ``recipe:``, so ``automodel run`` and ``automodel validate -c`` find it)."""

from __future__ import annotations

import re

import pytest

from automodel.testing import run_cli


@pytest.fixture
def nothing_is_built(monkeypatch):
    """Fail the test if validation lets the run reach the model or the recipe's setup."""
    from automodel.testing import ToyModel
    from automodel.training.recipe import TrainRecipe

    def forbidden(*args, **kwargs):
        raise AssertionError("a model/recipe was built although the config is invalid")

    monkeypatch.setattr(ToyModel, "__init__", forbidden)
    monkeypatch.setattr(TrainRecipe, "setup", forbidden)


def main(*args):
    from automodel.cli.main import main as cli_main

    return cli_main([str(a) for a in args])


def test_inconsistent_global_batch_size_is_exit_2_naming_the_three(make_toy, tmp_path, capsys, nothing_is_built):
    config = make_toy(step_scheduler={"grad_accumulation_steps": 3}, dataloader={"batch_size": 4})
    code = main("run", "-c", config, "--step_scheduler.global_batch_size", "16")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "step_scheduler.global_batch_size" in err
    assert re.search(r"batch_size \(4\)", err) and re.search(r"dp_size \(1\)", err)
    assert re.search(r"grad_accumulation_steps \(3\)", err) and "12" in err, err
    assert not (tmp_path / "ckpt").exists(), "an invalid run must not create its checkpoint directory"


def test_validate_command_reports_it_too(make_toy, capsys, nothing_is_built):
    config = make_toy(step_scheduler={"grad_accumulation_steps": 2, "global_batch_size": 4})
    assert main("validate", "-c", config) == 2
    assert "global_batch_size: 4 != batch_size (4) * dp_size (1) * grad_accumulation_steps (2)" in \
        capsys.readouterr().err
    assert main("run", "-c", config, "--dry-run") == 2  # the dry run refuses it as well
    assert "global_batch_size" in capsys.readouterr().err


def test_global_batch_size_derives_accumulation(make_toy, capsys, nothing_is_built):
    config = make_toy(step_scheduler={"grad_accumulation_steps": None, "global_batch_size": 16},
                      dataloader={"batch_size": 4})
    assert main("run", "-c", config, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "4 per micro-batch x 1 ranks x 4 accumulation = 16" in out, out


def test_indivisible_global_batch_size_is_exit_2(make_toy, capsys, nothing_is_built):
    config = make_toy(step_scheduler={"grad_accumulation_steps": None, "global_batch_size": 10},
                      dataloader={"batch_size": 4})
    assert main("run", "-c", config) == 2
    assert "not divisible" in capsys.readouterr().err


def test_consistent_global_batch_size_validates(make_toy, capsys, nothing_is_built):
    config = make_toy(step_scheduler={"grad_accumulation_steps": 2, "global_batch_size": 8},
                      dataloader={"batch_size": 4})
    assert main("run", "-c", config, "--dry-run") == 0, capsys.readouterr().err


def test_console_script_exit_code(make_toy, tmp_path):
    """Through the real console script: exit 2 with the message, and no checkpoint directory."""
    result = run_cli("run", "-c", make_toy(), "--step_scheduler.global_batch_size", "7", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "global_batch_size" in result.stderr and "batch_size (4)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "ckpt").exists()
