"""Crash safety: kill -9 anywhere never leaves LATEST pointing at an incomplete checkpoint, and a real write error
fails clearly and leaves the previous checkpoint intact (DESIGN §10; docs/reliability.md).

Each crash run is the real console script on the same config (8 steps, a checkpoint every 2, ``keep_last: 2``),
paused by the fault-injecting model target of reliability_helpers at one point and then killed with SIGKILL:

* ``step:3``         inside training step 3 (a torn metrics line is appended too, as a kill mid-write leaves);
* ``save_model:2``   the step-4 checkpoint's weights are in its staging directory, its other states are not;
* ``latest:2``       the step-4 checkpoint is renamed into place, LATEST still names step 2;
* ``retention:1``    keep_last is deleting step 2 and has already removed part of it.

After each kill the test checks the directory, then ``--restore_from.path latest`` (in this process) finishes the
run, and every step's loss equals the uninterrupted reference run's. The write-error run lowers the child's
file-size limit (``prlimit RLIMIT_FSIZE``, which binds root too) before its step-4 checkpoint.
"""

from __future__ import annotations

import resource
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import reliability_helpers as h

from automodel.testing import checkpoint_dirs, losses_by_step, read_jsonl, train_inprocess, write_yaml

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
_inprocess = pytest.fixture(scope="module", name="inprocess")(h.inprocess_env)

MAX_STEPS = 8
RUN = {"step_scheduler": {"max_steps": MAX_STEPS, "checkpoint_interval": 2}, "checkpoint": {"keep_last": 2}}
KILL_POINTS = ["step:3", "save_model:2", "latest:2", "retention:1"]
FINAL = ["epoch_1_step_6", "epoch_1_step_8"]
TORN_LINE = '{"step": 3, "epoch": 0, "loss": 6.1'


def _at_pause(point: str, root: Path) -> None:
    """What the directory looks like at the moment of the kill (so the kill really hits that point)."""
    staging = sorted(p.name for p in root.glob(".incomplete-*"))
    latest = (root / "LATEST").read_text().strip()
    if point == "step:3":
        assert (latest, checkpoint_dirs(root), staging) == ("epoch_0_step_2", ["epoch_0_step_2"], [])
    elif point == "save_model:2":
        assert latest == "epoch_0_step_2" and len(staging) == 1 and staging[0].startswith(".incomplete-epoch_0_step_4")
        partial = root / staging[0]
        assert list((partial / "model").glob("*.safetensors")) and not (partial / "optim").exists()
    elif point == "latest:2":
        assert latest == "epoch_0_step_2" and checkpoint_dirs(root) == ["epoch_0_step_2", "epoch_0_step_4"]
    elif point == "retention:1":
        assert latest == "epoch_1_step_6" and staging == [".incomplete-delete-epoch_0_step_2"]
        assert not (root / staging[0] / "model").exists() and (root / staging[0] / "optim").exists()


def _kill_at(point: str, proc, cwd: Path) -> None:
    marker = cwd / "paused"
    h.wait_for(marker.exists, proc, what=f"the pause at {point}")
    _at_pause(point, cwd / "ckpt")
    proc.send_signal(signal.SIGKILL)


def _limit_file_size(proc, cwd: Path) -> None:
    marker = cwd / "paused"
    h.wait_for(marker.exists, proc, what="step 3")
    limit = 16 * 1024  # the weights file (> 100 KiB) cannot be written; metrics lines still can
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
    (cwd / "paused.go").touch()


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, inprocess):
    root = tmp_path_factory.mktemp("crash")
    config = write_yaml(root / "cfg.yaml", h.run_config(h.write_tiny_llama(root / "model"), "ckpt", faulty=True,
                                                          **RUN))
    train_inprocess(config, "--checkpoint.checkpoint_dir", root / "reference" / "ckpt")
    reference = losses_by_step(root / "reference" / "ckpt" / "training.jsonl")
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))
    assert checkpoint_dirs(root / "reference" / "ckpt") == FINAL

    pauses = {**{point: point for point in KILL_POINTS}, "write_error": "step:3"}  # run name -> where it pauses
    procs = {}
    for name, pause in pauses.items():
        cwd = root / name.replace(":", "_")
        cwd.mkdir()
        procs[name] = (cwd, h.start_cli("finetune", "llm", "-c", config, cwd=cwd, log=cwd / "log.txt",
                                        OMP_NUM_THREADS="1", AMT_FAULT_PAUSE=pause,
                                        AMT_FAULT_MARKER=str(cwd / "paused")))

    def drive(name):
        cwd, proc = procs[name]
        try:
            if name in KILL_POINTS:
                _kill_at(name, proc, cwd)
            else:
                _limit_file_size(proc, cwd)
        finally:
            rc, log = h.finish(proc)
        return name, {"cwd": cwd, "rc": rc, "log": log}

    with ThreadPoolExecutor(len(pauses)) as pool:
        results = dict(pool.map(drive, pauses))
    return {"config": config, "reference": reference, **results}


def _resume_and_compare(crashed, cwd: Path, monkeypatch) -> None:
    monkeypatch.chdir(cwd)
    recipe = train_inprocess(crashed["config"], "--restore_from.path", "latest")
    assert recipe.step_scheduler.step == MAX_STEPS
    root = cwd / "ckpt"
    assert losses_by_step(root / "training.jsonl") == crashed["reference"]
    assert checkpoint_dirs(root) == FINAL  # keep_last: 2 is honoured
    assert h.assert_latest_is_complete(root) == FINAL[-1]
    leftovers = [p.name for p in root.iterdir() if p.name not in (*FINAL, "LATEST", "training.jsonl")]
    assert leftovers == [], leftovers  # staging, half-deleted and LATEST.tmp files are all cleared


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_9_leaves_latest_complete_and_restore_latest_continues_exactly(point, crashed, monkeypatch, inprocess):
    run = crashed[point]
    root = run["cwd"] / "ckpt"
    assert run["rc"] == -signal.SIGKILL, run["log"]
    expected_latest = {"step:3": "epoch_0_step_2", "save_model:2": "epoch_0_step_2", "latest:2": "epoch_0_step_2",
                       "retention:1": "epoch_1_step_6"}[point]
    assert h.assert_latest_is_complete(root) == expected_latest
    for name in checkpoint_dirs(root):  # whatever carries a checkpoint's name is a complete checkpoint
        h.assert_complete_checkpoint(root / name)
    logged = read_jsonl(root / "training.jsonl")
    for row in logged:
        assert row["loss"] == crashed["reference"][row["step"]]
    if point == "step:3":
        with open(root / "training.jsonl", "a") as f:
            f.write(TORN_LINE)  # what a kill in the middle of writing a metrics line leaves
    _resume_and_compare(crashed, run["cwd"], monkeypatch)


def test_write_error_fails_clearly_and_keeps_the_previous_checkpoint(crashed, monkeypatch, inprocess):
    run = crashed["write_error"]
    root = run["cwd"] / "ckpt"
    log = run["log"]
    assert run["rc"] == 1, log
    assert "Traceback" not in log
    assert "error: writing checkpoint 'ckpt/epoch_0_step_4' failed" in log
    assert "File too large" in log
    assert "the previous checkpoint is intact (ckpt/epoch_0_step_2)" in log
    assert checkpoint_dirs(root) == ["epoch_0_step_2"]
    assert h.assert_latest_is_complete(root) == "epoch_0_step_2"
    assert not list(root.glob(".incomplete-*")), "the failed checkpoint's staging directory is removed"
    _resume_and_compare(crashed, run["cwd"], monkeypatch)
