"""Crash safety: kill -9 anywhere never leaves LATEST naming an incomplete checkpoint, rerunning the same command
continues exactly (each step logged once), and a full disk fails clearly with LATEST intact (DESIGN §10;
docs/reliability.md).

Each crash run is the real console script on the same config (8 steps, a checkpoint every 2, ``keep_last: 2``),
paused by the fault-injecting model target of reliability_helpers at one point and then killed with SIGKILL:

* ``step:3``         inside training step 3 (a torn metrics line is appended too, as a kill mid-write leaves);
* ``write:2``        the step-4 checkpoint's shards are in its staging directory, its model/ is not written yet;
* ``latest:2``       the step-4 checkpoint is renamed into place, LATEST still names step 2;
* ``retention:1``    keep_last is deleting step 2 and has already removed part of it;
* ``exchange:1``     a rerun from step 6 of a finished run re-saves step 8, the step LATEST names: the new copy
  is complete beside the old one, about to be swapped in.

After each kill the test checks the directory, then reruns the same command (in this process): it resumes from
LATEST, and every step is logged once with the uninterrupted reference run's loss. The write-error runs lower the
child's file-size limit (``prlimit RLIMIT_FSIZE``, which binds root too) during step 3: below the weights' size
(the step-4 checkpoint fails) or below the next metrics line (training.jsonl fails).
"""

from __future__ import annotations

import resource
import shutil
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
KILL_POINTS = ["step:3", "write:2", "latest:2", "retention:1", "exchange:1"]
RESAVE = ("--restore_from.path", "epoch_1_step_6")  # the exchange run's command: a rerun from step 6
FINAL = ["epoch_1_step_6", "epoch_1_step_8"]
TORN_LINE = '{"step": 3, "epoch": 0, "loss": 6.1'


def _at_pause(point: str, root: Path) -> None:
    """What the directory looks like at the moment of the kill (so the kill really hits that point)."""
    staging = sorted(p.name for p in root.glob(".incomplete-*"))
    latest = (root / "LATEST").read_text().strip()
    if point == "step:3":
        assert (latest, checkpoint_dirs(root), staging) == ("epoch_0_step_2", ["epoch_0_step_2"], [])
    elif point == "write:2":
        assert latest == "epoch_0_step_2" and staging == [".incomplete-epoch_0_step_4"]
        partial = root / staging[0]
        assert list((partial / "model_shards").glob("shard-*.safetensors")) and not (partial / "model").exists()
    elif point == "latest:2":
        assert latest == "epoch_0_step_2" and checkpoint_dirs(root) == ["epoch_0_step_2", "epoch_0_step_4"]
    elif point == "retention:1":
        assert latest == "epoch_1_step_6" and staging == [".incomplete-delete-epoch_0_step_2"]
        assert not (root / staging[0] / "model").exists() and (root / staging[0] / "optim").exists()
    elif point == "exchange:1":
        assert latest == "epoch_1_step_8" and staging == [".incomplete-epoch_1_step_8"]
        h.assert_complete_checkpoint(root / staging[0])  # the new copy, complete before it is swapped in
    h.assert_latest_is_complete(root)


def _kill_at(point: str, proc, cwd: Path) -> None:
    marker = cwd / "paused"
    h.wait_for(marker.exists, proc, what=f"the pause at {point}")
    _at_pause(point, cwd / "ckpt")
    proc.send_signal(signal.SIGKILL)


def _limit_file_size(what: str):
    def limit(proc, cwd: Path) -> None:
        marker = cwd / "paused"
        h.wait_for(marker.exists, proc, what="step 3")
        # the weights file (> 100 KiB) cannot be written, metrics lines still can; or not even the next line
        size = 16 * 1024 if what == "checkpoint" else (cwd / "ckpt" / "training.jsonl").stat().st_size + 20
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (size, size))
        (cwd / "paused.go").touch()
    return limit


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, inprocess):
    root = tmp_path_factory.mktemp("crash")
    config = write_yaml(root / "cfg.yaml", h.run_config(h.write_tiny_llama(root / "model"), "ckpt", faulty=True,
                                                          **RUN))
    train_inprocess(config, "--checkpoint.checkpoint_dir", root / "reference" / "ckpt")
    reference = losses_by_step(root / "reference" / "ckpt" / "training.jsonl")
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))
    assert checkpoint_dirs(root / "reference" / "ckpt") == FINAL

    # run name -> (where it pauses, what the test does there)
    plan = {**{point: (point, _kill_at) for point in KILL_POINTS},
            "write_error": ("step:3", _limit_file_size("checkpoint")),
            "metrics_disk_full": ("step:3", _limit_file_size("metrics"))}
    procs = {}
    for name, (pause, _) in plan.items():
        cwd = root / name.replace(":", "_")
        cwd.mkdir()
        args = ()
        if name == "exchange:1":  # a finished run, rerun from step 6
            shutil.copytree(root / "reference" / "ckpt", cwd / "ckpt")
            args = RESAVE
        procs[name] = (cwd, h.start_cli("finetune", "llm", "-c", config, *args, cwd=cwd, log=cwd / "log.txt",
                                        piped=name == "metrics_disk_full", OMP_NUM_THREADS="1", AMT_FAULT_PAUSE=pause,
                                        AMT_FAULT_MARKER=str(cwd / "paused")))

    def drive(name):
        cwd, proc = procs[name]
        action = plan[name][1]
        try:
            if name in KILL_POINTS:
                action(name, proc, cwd)
            else:
                action(proc, cwd)
        finally:
            rc, log = h.finish(proc)
        return name, {"cwd": cwd, "rc": rc, "log": log}

    with ThreadPoolExecutor(len(plan)) as pool:
        results = dict(pool.map(drive, plan))
    return {"config": config, "reference": reference, **results}


def _rerun_and_compare(crashed, cwd: Path, monkeypatch, *args: str) -> None:
    """The same command again: it resumes from LATEST and ends as the uninterrupted run did."""
    monkeypatch.chdir(cwd)
    recipe = train_inprocess(crashed["config"], *args)
    assert recipe.step_scheduler.step == MAX_STEPS
    root = cwd / "ckpt"
    rows = read_jsonl(root / "training.jsonl")
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), "each step logged once"
    assert {r["step"]: r["loss"] for r in rows} == crashed["reference"]
    assert checkpoint_dirs(root) == FINAL  # keep_last: 2 is honoured
    assert h.assert_latest_is_complete(root) == FINAL[-1]
    leftovers = [p.name for p in root.iterdir() if p.name not in (*FINAL, "LATEST", "training.jsonl", ".lock")]
    assert leftovers == [], leftovers  # staging, half-deleted and LATEST.tmp files are all cleared


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_9_leaves_latest_complete_and_the_same_command_continues_exactly(point, crashed, monkeypatch, inprocess):
    run = crashed[point]
    root = run["cwd"] / "ckpt"
    assert run["rc"] == -signal.SIGKILL, run["log"]
    expected_latest = {"step:3": "epoch_0_step_2", "write:2": "epoch_0_step_2", "latest:2": "epoch_0_step_2",
                       "retention:1": "epoch_1_step_6", "exchange:1": "epoch_1_step_8"}[point]
    assert h.assert_latest_is_complete(root) == expected_latest
    for name in checkpoint_dirs(root):  # whatever carries a checkpoint's name is a complete checkpoint
        h.assert_complete_checkpoint(root / name)
    logged = read_jsonl(root / "training.jsonl")
    for row in logged:
        assert row["loss"] == crashed["reference"][row["step"]]
    if point == "step:3":
        with open(root / "training.jsonl", "a") as f:
            f.write(TORN_LINE)  # what a kill in the middle of writing a metrics line leaves
    _rerun_and_compare(crashed, run["cwd"], monkeypatch, *(RESAVE if point == "exchange:1" else ()))


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
    _rerun_and_compare(crashed, run["cwd"], monkeypatch)


def test_a_full_disk_while_logging_names_the_metrics_file_and_keeps_latest(crashed, monkeypatch, inprocess):
    run = crashed["metrics_disk_full"]
    root = run["cwd"] / "ckpt"
    log = run["log"]
    assert run["rc"] == 1, log
    assert "Traceback" not in log
    assert "error: writing 'ckpt/training.jsonl' failed: File too large" in log
    assert h.assert_latest_is_complete(root) == "epoch_0_step_2"
    _rerun_and_compare(crashed, run["cwd"], monkeypatch)
