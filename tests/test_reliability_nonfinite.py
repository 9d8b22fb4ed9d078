"""Non-finite losses: ``fault_tolerance.nonfinite: raise`` (the default) stops with the step and the last good
checkpoint; ``skip`` skips that step's update and counts skips in training.jsonl (docs/reliability.md).

NaN comes from a realistic learning rate (``--optimizer.lr 1e30``) and from the fault-injecting model target
of reliability_helpers (``nan_at_steps``: that step's logits are multiplied by NaN).
"""

from __future__ import annotations

import math

import pytest
import reliability_helpers as h

from automodel.testing import checkpoint_dirs, read_jsonl, train_inprocess, write_yaml

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
_inprocess = pytest.fixture(scope="module", name="inprocess")(h.inprocess_env)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    return h.write_tiny_llama(tmp_path_factory.mktemp("nonfinite_model"))


def _main(capsys, *argv) -> tuple[int, str]:
    from automodel.cli.main import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_huge_learning_rate_stops_with_the_step_and_no_checkpoint(model_config, tmp_path, monkeypatch, capsys,
                                                                  inprocess):
    monkeypatch.chdir(tmp_path)
    write_yaml(tmp_path / "cfg.yaml", h.run_config(model_config, step_scheduler={"checkpoint_interval": None}))
    rc, text = _main(capsys, "finetune", "llm", "-c", "cfg.yaml", "--optimizer.lr", "1e30")
    assert rc == 1 and "Traceback" not in text, text
    assert "error: step 2: the loss is" in text and "gradient norm nan" in text
    assert "training stopped (fault_tolerance.nonfinite: raise)" in text
    assert "no checkpoint was written before it" in text and "Lower optimizer.lr" in text
    assert [r["step"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [1]
    assert checkpoint_dirs(tmp_path / "ckpt") == [] and not (tmp_path / "ckpt" / "LATEST").exists()


def test_nan_loss_stops_with_the_step_and_the_last_good_checkpoint(model_config, tmp_path, monkeypatch, capsys,
                                                                    inprocess):
    monkeypatch.chdir(tmp_path)
    config = h.run_config(model_config, faulty=True)
    config["model"]["nan_at_steps"] = [3]
    write_yaml(tmp_path / "cfg.yaml", config)
    rc, text = _main(capsys, "finetune", "llm", "-c", "cfg.yaml")
    assert rc == 1 and "Traceback" not in text, text
    assert "error: step 3: the loss is nan" in text
    assert "the last good checkpoint is ckpt/epoch_0_step_2 (resume with --restore_from.path ckpt/epoch_0_step_2)" \
        in text
    root = tmp_path / "ckpt"
    assert [r["step"] for r in read_jsonl(root / "training.jsonl")] == [1, 2]
    assert checkpoint_dirs(root) == ["epoch_0_step_2"]  # nothing was saved from the bad step
    assert h.assert_latest_is_complete(root) == "epoch_0_step_2"


def _count_updates(counter: list):
    def before_run(recipe):
        real = recipe.optimizer.step

        def step(*args, **kwargs):
            counter.append(recipe.step_scheduler.step + 1)
            return real(*args, **kwargs)

        recipe.optimizer.step = step
    return before_run


def test_skip_policy_skips_the_update_and_counts_skipped_steps(model_config, tmp_path, monkeypatch, inprocess):
    monkeypatch.chdir(tmp_path)
    config = h.run_config(model_config, faulty=True, fault_tolerance={"nonfinite": "skip"})
    config["model"]["nan_at_steps"] = [3, 5]
    cfg = write_yaml(tmp_path / "cfg.yaml", config)
    updates: list[int] = []
    recipe = train_inprocess(cfg, before_run=_count_updates(updates))
    assert recipe.step_scheduler.step == 6
    assert updates == [1, 2, 4, 6], "steps 3 and 5 did not update the weights"
    rows = read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert [r["loss"] is None for r in rows] == [False, False, True, False, True, False]  # NaN is logged as null
    assert all(math.isfinite(r["loss"]) for r in rows if r["loss"] is not None)
    assert all(bool(p.isfinite().all()) for p in recipe.model.parameters())
    assert h.assert_latest_is_complete(tmp_path / "ckpt") == "epoch_1_step_6"


def test_skip_policy_gives_up_after_max_skipped_steps(model_config, tmp_path, monkeypatch, capsys, inprocess):
    monkeypatch.chdir(tmp_path)
    config = h.run_config(model_config, faulty=True, fault_tolerance={"nonfinite": "skip", "max_skipped_steps": 1})
    config["model"]["nan_at_steps"] = [3, 4]
    write_yaml(tmp_path / "cfg.yaml", config)
    rc, text = _main(capsys, "finetune", "llm", "-c", "cfg.yaml")
    assert rc == 1 and "Traceback" not in text, text
    assert "step 3: non-finite loss nan" in text and "update skipped (1 so far)" in text
    assert "error: step 4: the loss is nan" in text and "(fault_tolerance.nonfinite: skip)" in text
    assert "the last good checkpoint is ckpt/epoch_0_step_2" in text
