"""Fixtures for the retrieval domain's tests (helpers live in retrieval_testing.py).

The trained runs are session fixtures: one short bi-encoder run and one cross-encoder run serve the learning,
checkpoint and mining tests alike, which keeps the whole suite within about a minute and a half on 2 CPU cores.
"""

from __future__ import annotations

import pytest
import retrieval_testing as rt

from automodel.testing import read_jsonl


def _validation_before_training(recipe) -> None:
    recipe.validate()  # the untrained model's numbers, logged as step 0


@pytest.fixture(scope="session")
def bi_encoder_run(tmp_path_factory):
    """A 40-step bi-encoder run, validated before training (step 0) and after it."""
    root = tmp_path_factory.mktemp("bi_encoder")
    config = rt.write_config(root / "cfg.yaml", rt.BI_ENCODER, root / "ckpt",
                             step_scheduler={"max_steps": 40, "val_check_interval": 40})
    recipe = rt.run_inprocess("bi", config, before_run=_validation_before_training)
    return {"recipe": recipe, "root": root, "ckpt": root / "ckpt", "config": config,
            "validation": read_jsonl(root / "ckpt" / "validation.jsonl")}


@pytest.fixture(scope="session")
def cross_encoder_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross_encoder")
    config = rt.write_config(root / "cfg.yaml", rt.CROSS_ENCODER, root / "ckpt",
                             step_scheduler={"max_steps": 60, "val_check_interval": 60})
    recipe = rt.run_inprocess("cross", config, before_run=_validation_before_training)
    return {"recipe": recipe, "root": root, "ckpt": root / "ckpt", "config": config,
            "validation": read_jsonl(root / "ckpt" / "validation.jsonl")}
