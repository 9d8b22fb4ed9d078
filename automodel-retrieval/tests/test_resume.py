"""Exact resume: losses after a restore equal an uninterrupted run's, bitwise (dropout on, data shuffled).

16 training rows at batch size 4 make a 4-step epoch, so the 6-step runs cross an epoch boundary and the step-3
checkpoint lies mid-epoch.
"""

from __future__ import annotations

import pytest
import torch
from retrieval_testing import BI_ENCODER, CROSS_ENCODER, run_inprocess, write_config

from automodel.testing import checkpoint_dirs, read_jsonl

RUN = {"step_scheduler": {"max_steps": 6, "checkpoint_interval": 3, "log_interval": 1},
       "dataset": {"limit_dataset_samples": 16}, "dataloader": {"batch_size": 4, "shuffle": True},
       "validation_dataset": None, "model": {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}}


def _losses(path):
    return {r["step"]: r["loss"] for r in read_jsonl(path)}


@pytest.mark.parametrize("kind, base", [("bi", BI_ENCODER), ("cross", CROSS_ENCODER)], ids=["bi", "cross"])
def test_resume_continues_with_identical_losses(tmp_path, kind, base):
    config = write_config(tmp_path / "cfg.yaml", base, tmp_path / "ref", **RUN)
    reference = run_inprocess(kind, config)
    assert checkpoint_dirs(tmp_path / "ref") == ["epoch_0_step_3", "epoch_1_step_6"]
    expected = _losses(tmp_path / "ref" / "training.jsonl")
    resumed = run_inprocess(kind, config, "--checkpoint.checkpoint_dir", tmp_path / "resumed",
                            "--restore_from.path", tmp_path / "ref" / "epoch_0_step_3")
    got = _losses(tmp_path / "resumed" / "training.jsonl")
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in range(4, 7)] == [expected[s] for s in range(4, 7)], "losses after resume differ"
    for (name, a), b in zip(reference.model.state_dict().items(), resumed.model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
