"""The checkpoint directory: retention in the background, the run lock, LATEST valid at every instant of a
re-save (swap by rename, old copy deleted last), LATEST and trainer_state.json checked as untrusted input."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from automodel.training import checkpoint
from automodel.training.checkpoint import Checkpointer, CheckpointError, list_checkpoints, read_latest
from automodel.training.durable import RunLock
from automodel.training.sections import CheckpointConfig
from automodel.training.trainer_state import read_trainer_state


def _checkpointer(root: Path, keep_last: int | None = None) -> Checkpointer:
    ck = Checkpointer(CheckpointConfig(checkpoint_dir=str(root), keep_last=keep_last), "a: 1\n")
    ck.prepare()
    return ck


def _save(ck: Checkpointer, step: int, content: str = "new") -> Path:
    staging, final = ck.staging_path(0, step)
    ck.open_staging(staging)
    (staging / "weights").write_text(content)
    return ck.publish(staging, final)


def test_retired_checkpoint_is_renamed_at_once_and_deleted_in_the_background(tmp_path, monkeypatch):
    release = threading.Event()
    real_delete = checkpoint._delete_all

    def slow_delete(directories):
        release.wait(10)
        real_delete(directories)

    monkeypatch.setattr(checkpoint, "_delete_all", slow_delete)
    ck = _checkpointer(tmp_path, keep_last=1)
    _save(ck, 1)
    second = _save(ck, 2)  # returns while the first is still being deleted
    assert [p.name for p in list_checkpoints(tmp_path)] == [second.name]
    assert read_latest(tmp_path) == second
    assert [p.name for p in tmp_path.glob(".incomplete-delete-*")] == [".incomplete-delete-epoch_0_step_1"]
    release.set()
    ck.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", second.name]
    ck.release()


def test_prepare_removes_a_deletion_cut_short(tmp_path):
    leftover = tmp_path / ".incomplete-delete-epoch_0_step_1"
    (leftover / "model").mkdir(parents=True)
    _checkpointer(tmp_path, keep_last=1).release()
    assert not leftover.exists()


def test_retention_never_retires_the_checkpoint_latest_names_for_a_newer_one(tmp_path):
    """A checkpoint newer than LATEST (a resumed run's future, or a damaged name) never retires the good one."""
    ck = _checkpointer(tmp_path, keep_last=1)
    (tmp_path / "epoch_0_step_9").mkdir()  # the abandoned future of an earlier run
    (tmp_path / f"epoch_0_step_{10**30}").mkdir()  # out of range: not a checkpoint name at all
    _save(ck, 2)
    good = _save(ck, 4)
    assert read_latest(tmp_path) == good
    assert [p.name for p in list_checkpoints(tmp_path)] == ["epoch_0_step_4", "epoch_0_step_9"]  # step 2 retired
    assert (tmp_path / f"epoch_0_step_{10**30}").is_dir()  # not a checkpoint: neither counted nor deleted
    ck.release()


def test_re_saving_the_step_latest_names_keeps_latest_valid_at_every_instant(tmp_path, monkeypatch):
    ck = _checkpointer(tmp_path)
    _save(ck, 2, "old")
    seen = []
    real_replace, real_exchange, real_rmtree = os.replace, checkpoint.exchange, checkpoint.shutil.rmtree

    def observe():  # LATEST names a complete checkpoint before and after every rename and deletion
        seen.append((read_latest(tmp_path) / "weights").read_text())

    def replace(a, b):
        observe()
        real_replace(a, b)
        observe()

    def exchange(a, b):
        observe()
        assert real_exchange(a, b), "this file system cannot exchange directories"
        observe()
        return True

    def rmtree(path, *args, **kwargs):
        observe()
        real_rmtree(path, *args, **kwargs)
        observe()

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    monkeypatch.setattr(checkpoint, "exchange", exchange)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    _save(ck, 2, "new")
    monkeypatch.undo()
    assert seen[0] == "old" and seen[-1] == "new" and set(seen) == {"old", "new"}, seen
    assert (tmp_path / "epoch_0_step_2" / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "epoch_0_step_2"]  # old copy gone
    ck.release()


def test_without_an_atomic_swap_a_re_save_moves_the_old_copy_aside_first(tmp_path, monkeypatch):
    ck = _checkpointer(tmp_path)
    _save(ck, 2, "old")
    monkeypatch.setattr(checkpoint, "exchange", lambda a, b: False)
    _save(ck, 2, "new")
    assert (read_latest(tmp_path) / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "epoch_0_step_2"]
    ck.release()


def test_a_crash_between_the_two_renames_of_a_re_save_is_repaired(tmp_path):
    """Where the file system cannot exchange: LATEST names a step whose copy was moved aside, then the kill."""
    ck = _checkpointer(tmp_path)
    _save(ck, 2, "old")
    ck.release()
    os.replace(tmp_path / "epoch_0_step_2", tmp_path / ".incomplete-old-epoch_0_step_2")
    (tmp_path / ".incomplete-epoch_0_step_2").mkdir()  # the new copy, complete or not: discarded
    ck = _checkpointer(tmp_path)
    assert (read_latest(tmp_path) / "weights").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "epoch_0_step_2"]
    ck.release()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name the file behind an fsync")
def test_every_file_and_directory_reaches_the_disk_before_latest_names_it(tmp_path, monkeypatch):
    """A power cut after LATEST is replaced finds the checkpoint it names complete: every file and directory of it
    was fsynced, its rename into place too (the parent directory), and LATEST's own content before its rename."""
    root = tmp_path.resolve()
    ck = _checkpointer(root)
    staging, final = ck.staging_path(0, 2)
    ck.open_staging(staging)
    (staging / "model").mkdir()
    (staging / "model" / "model.safetensors").write_bytes(b"weights")
    (staging / "trainer_state.json").write_text("{}")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    ck.publish(staging, final)
    monkeypatch.undo()
    renames = [i for i, event in enumerate(events) if event[0] == "rename"]
    into_place = next(i for i in renames if events[i][1:] == (str(staging), str(final)))
    latest = next(i for i in renames if events[i][2] == str(root / "LATEST"))
    synced = {event[1] for event in events[:into_place] if event[0] == "fsync"}
    expected = {str(staging), str(staging / "model"), str(staging / "model" / "model.safetensors"),
                str(staging / "trainer_state.json")}
    assert expected <= synced, (expected - synced, events)
    assert ("fsync", str(root)) in events[into_place:latest], "the rename into place is durable before LATEST"
    assert ("fsync", events[latest][1]) in events[into_place:latest], "LATEST's content is on disk before its rename"
    assert ("fsync", str(root)) in events[latest:], "the new LATEST entry itself is made durable"
    ck.release()


@pytest.mark.parametrize("name", ["../x", "/etc", "a/b", "epoch_0_step_2/..", "", "epoch_0_step_" + "9" * 20])
def test_latest_must_name_a_checkpoint_inside_the_directory(name, tmp_path):
    (tmp_path / "LATEST").write_text(name + "\n")
    with pytest.raises(CheckpointError, match=r"LATEST' names .*which is not a checkpoint directory inside"):
        read_latest(tmp_path)


def test_latest_naming_a_missing_checkpoint_is_refused(tmp_path):
    (tmp_path / "LATEST").write_text("epoch_0_step_4\n")
    with pytest.raises(CheckpointError, match="names 'epoch_0_step_4', which does not exist"):
        read_latest(tmp_path)


def _trainer_state(**changes):
    state = {"format": 2, "step": 2, "epoch": 0, "losses": [1.0, 0.5], "world_size": 1, "skipped_steps": 0,
             "step_scheduler": {"step": 2, "epoch": 0, "epoch_step": 2}, "weights": "model"}
    return {**state, **changes}


@pytest.mark.parametrize(("changes", "message"), [
    ({"step": 10**30, "step_scheduler": {"step": 10**30, "epoch": 0, "epoch_step": 2}},
     "'step' must be an integer from 0 to 1000000000000"),
    ({"step": "2"}, "'step' must be an integer"),
    ({"step": True}, "'step' must be an integer"),
    ({"world_size": 0}, "'world_size' must be an integer from 1"),
    ({"dp_size": 2}, "'dp_size' must be an integer from 1 to 1"),
    ({"losses": ["x"]}, "'losses' must be a list"),
    ({"step_scheduler": {"step": 3, "epoch": 0, "epoch_step": 2}}, "disagrees with step 2"),
    ({"step": 3, "step_scheduler": {"step": 3, "epoch": 0, "epoch_step": 2}}, "says epoch 0 step 3 but its "
                                                                              "directory is 'epoch_0_step_2'"),
    ({"weights": "elsewhere"}, "'weights' must be one of"),
    ({"format": None}, "written by an earlier automodel"),
])
def test_trainer_state_numbers_are_checked(changes, message, tmp_path):
    path = tmp_path / "epoch_0_step_2"
    path.mkdir()
    (path / "trainer_state.json").write_text(json.dumps(_trainer_state(**changes)))
    with pytest.raises(CheckpointError, match=message) as info:
        read_trainer_state(path)
    assert "--restore_from.path" in str(info.value)


def test_a_corrupted_trainer_state_names_the_file(tmp_path):
    (tmp_path / "trainer_state.json").write_text('{"step": 2, "ep')
    with pytest.raises(CheckpointError, match=r"trainer_state.json' is corrupted \(JSONDecodeError"):
        read_trainer_state(tmp_path)


def test_a_second_run_is_refused_with_the_holders_pid_and_host(tmp_path):
    first = _checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=rf"is in use by another run \(pid {os.getpid()} on host "
                                              rf"{socket.gethostname()}\); wait for it"):
        _checkpointer(tmp_path)
    first.release()
    _checkpointer(tmp_path).release()


def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path):
    code = ("import sys, time; from automodel.training.durable import RunLock; "
            "lock = RunLock(sys.argv[1]); assert lock.acquire() is None; print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    assert RunLock(tmp_path).acquire() == f"pid {proc.pid} on host {socket.gethostname()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lock = RunLock(tmp_path)
    assert lock.acquire() is None  # the kernel released the dead holder's flock
    lock.release()


@pytest.mark.parametrize("layout, advice", [
    ({"model/.metadata": b"\x80\x04", "model/__0_0.distcp": b"\x80\x04"},
     "in torch.distributed.checkpoint's pickle format (model/.metadata, *.distcp: upstream's torch_save), which is "
     "never read here"),
    ({"model/consolidated/config.json": b"{}", "step_scheduler.pt": b"\x80\x04"},
     "but its Hugging Face model is: start a run from it with model.pretrained_model_name_or_path: {path}/model/"
     "consolidated"),
    ({"model/weights.bin": b""}, None),
])
def test_restoring_from_an_upstream_checkpoint_says_what_to_do_instead(tmp_path, layout, advice):
    """Upstream NeMo AutoModel's checkpoints keep their training state in pickles, never read here; the refusal
    says which of its parts can be used (the Hugging Face model of save_consolidated) and how."""
    path = tmp_path / "epoch_0_step_10"
    for name, content in layout.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(content)
    ck = _checkpointer(tmp_path / "run")
    with pytest.raises(CheckpointError, match="is not a checkpoint") as info:
        ck.resolve(str(path))
    ck.release()
    text = str(info.value)
    if advice is None:
        assert "upstream" not in text, text
    else:
        assert "It is an upstream NeMo AutoModel checkpoint" in text and advice.format(path=path) in text, text
