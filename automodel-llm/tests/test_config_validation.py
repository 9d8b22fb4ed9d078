"""Batch arithmetic is checked when the config is validated, before anything is built (DESIGN §6)."""

from __future__ import annotations

import re

import pytest
from llm_testing import run_cli


@pytest.fixture
def nothing_is_built(monkeypatch):
    """Fail the test if validation lets the run reach the model or the recipe's setup."""
    import automodel_llm
    from automodel.training.recipe import TrainRecipe

    def forbidden(*args, **kwargs):
        raise AssertionError("a model/recipe was built although the config is invalid")

    monkeypatch.setattr(automodel_llm.AutoModelForCausalLM, "from_config", classmethod(forbidden))
    monkeypatch.setattr(automodel_llm.AutoModelForCausalLM, "from_pretrained", classmethod(forbidden))
    monkeypatch.setattr(TrainRecipe, "setup", forbidden)


def main(*args):
    from automodel.cli.main import main as cli_main

    return cli_main([str(a) for a in args])


def test_inconsistent_global_batch_size_is_exit_2_naming_the_three(make_config, tmp_path, capsys, nothing_is_built):
    config = make_config(step_scheduler={"grad_accumulation_steps": 3}, dataloader={"batch_size": 4})
    code = main("finetune", "llm", "-c", config, "--step_scheduler.global_batch_size", "16")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "step_scheduler.global_batch_size" in err
    assert re.search(r"batch_size \(4\)", err) and re.search(r"dp_size \(1\)", err)
    assert re.search(r"grad_accumulation_steps \(3\)", err) and "12" in err, err
    assert not (tmp_path / "ckpt").exists(), "an invalid run must not create its checkpoint directory"


def test_validate_command_reports_it_too(make_config, capsys, nothing_is_built):
    config = make_config(step_scheduler={"grad_accumulation_steps": 2, "global_batch_size": 4})
    assert main("validate", "finetune", "llm", "-c", config) == 2
    assert "global_batch_size: 4 != batch_size (4) * dp_size (1) * grad_accumulation_steps (2)" in \
        capsys.readouterr().err
    assert main("validate", "-c", config) == 2  # the best-fitting route reports it as well
    assert "global_batch_size" in capsys.readouterr().err


def test_global_batch_size_derives_accumulation(make_config, capsys, nothing_is_built):
    config = make_config(step_scheduler={"grad_accumulation_steps": None, "global_batch_size": 16},
                         dataloader={"batch_size": 4})
    assert main("finetune", "llm", "-c", config, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "4 per micro-batch x 1 ranks x 4 accumulation = 16" in out, out


def test_indivisible_global_batch_size_is_exit_2(make_config, capsys, nothing_is_built):
    config = make_config(step_scheduler={"grad_accumulation_steps": None, "global_batch_size": 10},
                         dataloader={"batch_size": 4})
    assert main("finetune", "llm", "-c", config) == 2
    assert "not divisible" in capsys.readouterr().err


def test_consistent_global_batch_size_validates(make_config, capsys, nothing_is_built):
    config = make_config(step_scheduler={"grad_accumulation_steps": 2, "global_batch_size": 8},
                         dataloader={"batch_size": 4})
    assert main("finetune", "llm", "-c", config, "--dry-run") == 0, capsys.readouterr().err


def test_console_script_exit_code_and_speed(make_config, tmp_path):
    """Through the real console script: exit 2 with the message, and no checkpoint directory."""
    import time

    config = make_config()
    start = time.perf_counter()
    result = run_cli("finetune", "llm", "-c", config, "--step_scheduler.global_batch_size", "7", cwd=tmp_path)
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.stderr
    assert "global_batch_size" in result.stderr and "batch_size (4)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "ckpt").exists()
    assert elapsed < 60
