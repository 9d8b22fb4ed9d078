"""keep_last: retired checkpoints leave their names at once and their files on a background thread."""

from __future__ import annotations

import threading
from pathlib import Path

from automodel.training import checkpoint
from automodel.training.checkpoint import Checkpointer, list_checkpoints, read_latest
from automodel.training.sections import CheckpointConfig


def _weights(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"x" * 4096)


def test_retired_checkpoint_is_renamed_at_once_and_deleted_in_the_background(tmp_path, monkeypatch):
    release = threading.Event()
    real_delete = checkpoint._delete_all

    def slow_delete(directories):
        release.wait(10)
        real_delete(directories)

    monkeypatch.setattr(checkpoint, "_delete_all", slow_delete)
    ck = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path), keep_last=1), "a: 1\n")
    ck.prepare()
    ck.save({}, _weights, {"step": 1}, 0, 1)
    second = ck.save({}, _weights, {"step": 2}, 0, 2)  # returns while the first is still being deleted
    assert [p.name for p in list_checkpoints(tmp_path)] == [second.name]
    assert read_latest(tmp_path) == second
    assert [p.name for p in tmp_path.glob(".incomplete-delete-*")] == [".incomplete-delete-epoch_0_step_1"]
    release.set()
    ck.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", second.name]


def test_prepare_removes_a_deletion_cut_short(tmp_path):
    leftover = tmp_path / ".incomplete-delete-epoch_0_step_1"
    (leftover / "model").mkdir(parents=True)
    Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path), keep_last=1), "a: 1\n").prepare()
    assert not leftover.exists()
