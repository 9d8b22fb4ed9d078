"""SIGTERM / SIGINT during training, through the real console script (DESIGN §10; docs/reliability.md).

A signal finishes the current step, writes a checkpoint, and exits 128 + signal with a message naming the
checkpoint and how to resume; ``--restore_from.path latest`` then completes the run with the losses of a run
that never stopped. So does SIGTERM to the whole process group (a scheduler's preemption) of a run whose data loader
has worker processes. A second SIGINT aborts at once, without a checkpoint. The four runs go side by side.
"""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import reliability_helpers as h

from automodel.testing import checkpoint_dirs, losses_by_step, read_jsonl, train_inprocess, write_yaml

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
_inprocess = pytest.fixture(scope="module", name="inprocess")(h.inprocess_env)

MAX_STEPS = 10
RUN = {"step_scheduler": {"max_steps": MAX_STEPS, "checkpoint_interval": 4}}


def _signal_when_training(proc, cwd: Path, signum: int, group: bool = False) -> None:
    """``signum`` after the first metrics line, to the run's process or (``group``) its whole process group."""
    h.wait_for(lambda: h.jsonl_lines(cwd / "ckpt" / "training.jsonl") >= 1, proc, what="the first metrics line")
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)


def _double_sigint(proc, cwd: Path) -> None:
    marker = cwd / "paused"
    h.wait_for(marker.exists, proc, what="step 6")
    proc.send_signal(signal.SIGINT)
    h.wait_for(lambda: "received SIGINT" in proc.log_path.read_text(), proc, what="the first SIGINT's notice")
    proc.send_signal(signal.SIGINT)  # the step is still running (paused): this one must abort


@pytest.fixture(scope="module")
def runs(tmp_path_factory, inprocess):
    """The uninterrupted reference, then three interrupted runs of the same config side by side."""
    root = tmp_path_factory.mktemp("signals")
    config = write_yaml(root / "cfg.yaml", h.run_config(h.write_tiny_llama(root / "model"), "ckpt", faulty=True,
                                                          **RUN))
    train_inprocess(config, "--checkpoint.checkpoint_dir", root / "reference" / "ckpt")
    reference = losses_by_step(root / "reference" / "ckpt" / "training.jsonl")
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))

    plans = {
        "sigterm": ({"AMT_FAULT_SLEEP": "0.5"}, lambda p, c: _signal_when_training(p, c, signal.SIGTERM)),
        "sigint": ({"AMT_FAULT_SLEEP": "0.5"}, lambda p, c: _signal_when_training(p, c, signal.SIGINT)),
        "double_sigint": ({"AMT_FAULT_PAUSE": "step:6"}, _double_sigint),
        "sigterm_workers": ({"AMT_FAULT_SLEEP": "0.5"},
                            lambda p, c: _signal_when_training(p, c, signal.SIGTERM, group=True)),
    }
    procs = {}
    for name, (env, _) in plans.items():
        cwd = root / name
        cwd.mkdir()
        if "AMT_FAULT_PAUSE" in env:
            env = {**env, "AMT_FAULT_MARKER": str(cwd / "paused")}
        workers = ("--dataloader.num_workers", 1) if name == "sigterm_workers" else ()
        procs[name] = (cwd, h.start_cli("finetune", "llm", "-c", config, *workers, cwd=cwd, log=cwd / "log.txt",
                                        new_session=bool(workers), OMP_NUM_THREADS="1", **env))

    def drive(name):
        cwd, proc = procs[name]
        try:
            plans[name][1](proc, cwd)
        finally:
            rc, log = h.finish(proc)
        return name, {"cwd": cwd, "rc": rc, "log": log}

    with ThreadPoolExecutor(len(plans)) as pool:
        results = dict(pool.map(drive, plans))
    return {"config": config, "reference": reference, **results}


STOPPED = re.compile(r"stopped by (SIGTERM|SIGINT) after step (\d+); checkpoint: (\S+); "
                     r"resume with --restore_from\.path latest")


def _check_graceful_stop(run, name: str, code: int, reference) -> int:
    cwd, log = run["cwd"], run["log"]
    assert run["rc"] == 128 + code, log
    assert "Traceback" not in log
    assert f"received {name}: finishing the current step, then writing a checkpoint" in log
    match = STOPPED.search(log)
    assert match and match.group(1) == name, log
    step = int(match.group(2))
    assert 1 <= step < MAX_STEPS
    root = cwd / "ckpt"
    latest = h.assert_latest_is_complete(root)
    assert match.group(3) == f"ckpt/{latest}" and latest.endswith(f"_step_{step}")
    rows = read_jsonl(root / "training.jsonl")
    assert [r["step"] for r in rows] == list(range(1, step + 1)), "the current step is finished, no more"
    assert not list(root.glob(".incomplete-*"))
    for r in rows:
        assert r["loss"] == reference[r["step"]]
    return step


def _check_resumed(cwd: Path, step: int, reference) -> None:
    root = cwd / "ckpt"
    losses = losses_by_step(root / "training.jsonl")
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert losses == reference, "the resumed run continues with the losses of the uninterrupted one"
    assert (root / "LATEST").read_text().strip().endswith(f"_step_{MAX_STEPS}")
    assert [r["step"] for r in read_jsonl(root / "training.jsonl")] == [*range(1, step + 1),
                                                                           *range(step + 1, MAX_STEPS + 1)]


def test_sigterm_checkpoints_then_restore_latest_completes_exactly(runs, monkeypatch, inprocess):
    step = _check_graceful_stop(runs["sigterm"], "SIGTERM", signal.SIGTERM, runs["reference"])
    monkeypatch.chdir(runs["sigterm"]["cwd"])
    recipe = train_inprocess(runs["config"], "--restore_from.path", "latest")
    assert recipe.step_scheduler.step == MAX_STEPS
    _check_resumed(runs["sigterm"]["cwd"], step, runs["reference"])


def test_sigint_checkpoints_then_the_console_script_resumes(runs):
    cwd = runs["sigint"]["cwd"]
    step = _check_graceful_stop(runs["sigint"], "SIGINT", signal.SIGINT, runs["reference"])
    latest = (cwd / "ckpt" / "LATEST").read_text().strip()
    proc = h.start_cli("finetune", "llm", "-c", runs["config"], "--restore_from.path", "latest", cwd=cwd,
                       log=cwd / "resume.txt", OMP_NUM_THREADS="1")
    rc, log = h.finish(proc)
    assert rc == 0, log
    assert f"resumed from ckpt/{latest} at step {step}" in log
    _check_resumed(cwd, step, runs["reference"])


def test_sigterm_to_the_process_group_with_loader_workers_checkpoints_too(runs):
    """The workers ignore the signal (a killed one would make torch raise in the training process mid-step)."""
    _check_graceful_stop(runs["sigterm_workers"], "SIGTERM", signal.SIGTERM, runs["reference"])
    assert "DataLoader worker" not in runs["sigterm_workers"]["log"]


def test_second_sigint_aborts_at_once_without_a_checkpoint(runs):
    run = runs["double_sigint"]
    root = run["cwd"] / "ckpt"
    assert run["rc"] == 130, run["log"]
    assert re.search(r"^(aborted|interrupted)$", run["log"], re.M) and "Traceback" not in run["log"]
    assert "stopped by SIGINT" not in run["log"]  # it did not wait for the step to finish
    assert [r["step"] for r in read_jsonl(root / "training.jsonl")] == [1, 2, 3, 4, 5]
    assert checkpoint_dirs(root) == ["epoch_0_step_4"]  # the one before; nothing for step 6
    assert h.assert_latest_is_complete(root) == "epoch_0_step_4"
    assert not list(root.glob(".incomplete-*"))
