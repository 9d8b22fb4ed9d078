"""Exact resume (DESIGN §10): a restored run continues with the same losses and weights as one that never stopped.

The data set is 16 samples at batch size 4 with shuffling on, so an epoch is 4 steps and a 10-step run crosses
two epoch boundaries; the step-6 checkpoint lies mid-epoch, the step-4 one exactly at an epoch's end.
"""

from __future__ import annotations

import json
import shutil

import pytest

from automodel.testing import assert_states_equal, checkpoint_dirs, load_safetensors_state, read_jsonl, train_inprocess

RUN = {"step_scheduler": {"max_steps": 10, "checkpoint_interval": 2, "log_interval": 1},
       "dataset": {"limit_dataset_samples": 16}, "dataloader": {"batch_size": 4, "shuffle": True}}


def losses(path, steps):
    by_step = {r["step"]: r["loss"] for r in read_jsonl(path)}
    return [by_step[s] for s in steps]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_llama_config):
    """One uninterrupted 10-step run: its checkpoints, losses and final weights."""
    from llm_testing import write_config

    root = tmp_path_factory.mktemp("resume_ref")
    config = write_config(root / "cfg.yaml", tiny_llama_config, root / "ckpt", **RUN)
    recipe = train_inprocess(config)
    final = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
    # two more epochs of the loader (each told its epoch, as the loop tells it), to check that shuffling is really on
    orders = []
    for epoch in (3, 4):
        recipe.dataloader.sampler.set_epoch(epoch)
        orders.append([tuple(row[:int(n)]) for b in recipe.dataloader
                       for row, n in zip(b["input_ids"].tolist(), b["attention_mask"].sum(1), strict=True)])
    return {"config": config, "ckpt": root / "ckpt", "final": final, "orders": orders,
            "dataset": recipe.train_dataset,
            "losses": losses(root / "ckpt" / "training.jsonl", range(1, 11))}


def test_reference_run_crosses_epochs_with_shuffle(reference):
    names = checkpoint_dirs(reference["ckpt"])
    assert names == ["epoch_0_step_2", "epoch_0_step_4", "epoch_1_step_6", "epoch_1_step_8", "epoch_2_step_10"]
    epochs = [r["epoch"] for r in read_jsonl(reference["ckpt"] / "training.jsonl")]
    assert epochs == [0] * 4 + [1] * 4 + [2] * 2
    first, second = reference["orders"]
    assert first != second, "each epoch should shuffle differently"
    assert sorted(first) == sorted(second)
    assert len(first) == len(reference["dataset"]) == 16
    in_order = [reference["dataset"][i]["input_ids"] for i in range(4)]
    assert [list(row) for row in first[:4]] != in_order, "data is not shuffled"


def test_resume_from_checkpoint_path_is_exact(reference, tmp_path):
    source = reference["ckpt"] / "epoch_1_step_6"
    recipe = train_inprocess(reference["config"], "--checkpoint.checkpoint_dir", tmp_path / "resumed",
                             "--restore_from.path", source)
    assert recipe.step_scheduler.step == 10
    rows = read_jsonl(tmp_path / "resumed" / "training.jsonl")
    assert [r["step"] for r in rows] == [7, 8, 9, 10]
    assert [r["loss"] for r in rows] == reference["losses"][6:], "losses after resume differ (bitwise)"
    assert_states_equal(recipe.model.state_dict(), reference["final"])
    assert_states_equal(load_safetensors_state(tmp_path / "resumed" / "epoch_2_step_10" / "model"),
                        load_safetensors_state(reference["ckpt"] / "epoch_2_step_10" / "model"))
    # trainer_state carries the pre-resume losses on
    state = json.loads((tmp_path / "resumed" / "epoch_2_step_10" / "trainer_state.json").read_text())
    assert state["step"] == 10 and state["losses"] == reference["losses"]


def test_resume_latest_at_epoch_boundary(reference, tmp_path):
    """``restore_from.path: latest`` in a checkpoint_dir whose LATEST names the end-of-epoch checkpoint."""
    root = tmp_path / "ckpt"
    root.mkdir()
    shutil.copytree(reference["ckpt"] / "epoch_0_step_4", root / "epoch_0_step_4")
    (root / "LATEST").write_text("epoch_0_step_4\n")
    recipe = train_inprocess(reference["config"], "--checkpoint.checkpoint_dir", root, "--restore_from.path", "latest")
    assert losses(root / "training.jsonl", range(5, 11)) == reference["losses"][4:]
    assert_states_equal(recipe.model.state_dict(), reference["final"])
    assert (root / "LATEST").read_text().strip() == "epoch_2_step_10"


def test_resume_by_directory_name_into_same_dir(reference, tmp_path):
    """A bare checkpoint name resolves under checkpoint_dir; resuming into the run's own directory drops the
    records past the restored step (each step is logged once) and re-saves steps 8 and 10 in place."""
    root = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], root)
    recipe = train_inprocess(reference["config"], "--checkpoint.checkpoint_dir", root,
                             "--restore_from.path", "epoch_1_step_6")
    rows = read_jsonl(root / "training.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [r["loss"] for r in rows] == reference["losses"]
    assert_states_equal(recipe.model.state_dict(), reference["final"])
    assert (root / "LATEST").read_text().strip() == "epoch_2_step_10"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".incomplete")]


def test_restore_from_missing_checkpoint_is_a_clear_error(reference, tmp_path):
    from automodel.errors import AutomodelError

    with pytest.raises(AutomodelError, match="restore_from.path: 'epoch_0_step_2' is not a checkpoint"):
        train_inprocess(reference["config"], "--checkpoint.checkpoint_dir", tmp_path / "empty",
                        "--restore_from.path", "epoch_0_step_2")


def test_a_resume_never_unpickles(reference, tmp_path, monkeypatch):
    """Everything a resume reads is JSON or safetensors: with pickle and torch.load refusing, it continues."""
    import pickle

    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint read unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    recipe = train_inprocess(reference["config"], "--checkpoint.checkpoint_dir", tmp_path / "resumed",
                             "--restore_from.path", reference["ckpt"] / "epoch_1_step_6")
    monkeypatch.undo()
    assert [r["loss"] for r in read_jsonl(tmp_path / "resumed" / "training.jsonl")] == reference["losses"][6:]
    assert_states_equal(recipe.model.state_dict(), reference["final"])


def test_a_checkpoint_saved_only_sharded_resumes_exactly(reference, tmp_path):
    """``checkpoint.save_consolidated: false``: the weights are only model_shards/, and a resume reads them."""
    sharded = tmp_path / "sharded"
    train_inprocess(reference["config"], "--checkpoint.checkpoint_dir", sharded,
                    "--checkpoint.save_consolidated", "false")
    saved = sharded / "epoch_1_step_6"
    assert not (saved / "model").exists() and list((saved / "model_shards").glob("shard-*.safetensors"))
    assert json.loads((saved / "trainer_state.json").read_text())["weights"] == "model_shards"
    assert losses(sharded / "training.jsonl", range(1, 11)) == reference["losses"]
    recipe = train_inprocess(reference["config"], "--checkpoint.checkpoint_dir", tmp_path / "resumed",
                             "--restore_from.path", saved)
    assert [r["loss"] for r in read_jsonl(tmp_path / "resumed" / "training.jsonl")] == reference["losses"][6:]
    assert_states_equal(recipe.model.state_dict(), reference["final"])


def test_a_resume_drops_the_validation_records_past_the_restored_step(tiny_llama_config, tmp_path):
    """Resumed into its own directory from step 2, the run validates steps 4 and 6 again: each step once, with the
    uninterrupted run's numbers."""
    from llm_testing import VALIDATION, write_config

    root = tmp_path / "ckpt"
    config = write_config(tmp_path / "cfg.yaml", tiny_llama_config, root, validation_dataset=VALIDATION,
                          step_scheduler={"max_steps": 6, "checkpoint_interval": 2, "val_check_interval": 2})
    train_inprocess(config)
    first = read_jsonl(root / "validation.jsonl")
    assert [r["step"] for r in first] == [2, 4, 6]
    train_inprocess(config, "--restore_from.path", "epoch_0_step_2")
    again = read_jsonl(root / "validation.jsonl")
    assert [r["step"] for r in again] == [2, 4, 6]
    assert [r["val_loss"] for r in again] == [r["val_loss"] for r in first]
    assert [r["step"] for r in read_jsonl(root / "training.jsonl")] == [1, 2, 3, 4, 5, 6]
