"""Checkpoints as untrusted input and runs that never clobber each other (DESIGN §10; docs/reliability.md).

One finished run (4 steps, checkpoints at 2 and 4) is copied for each case, which damages it and runs the same
command through the CLI in this process with ``--step_scheduler.max_steps 6``: it resumes from LATEST, so every
file a resume reads is read. A damaged file is refused with exit 1, the file's name and what to do, never a
traceback, and nothing of the good checkpoints is replaced or retired.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
from pathlib import Path

import pytest
import reliability_helpers as h

from automodel.testing import checkpoint_dirs, read_jsonl, train_inprocess, write_yaml

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
_inprocess = pytest.fixture(scope="module", name="inprocess")(h.inprocess_env)

RUN = {"step_scheduler": {"max_steps": 4, "checkpoint_interval": 2}}
MORE = ("--step_scheduler.max_steps", "6")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, inprocess):
    root = tmp_path_factory.mktemp("finished")
    config = write_yaml(root / "cfg.yaml", h.run_config(h.write_tiny_llama(root / "model"), "ckpt", faulty=True,
                                                          **RUN))
    train_inprocess(config, "--checkpoint.checkpoint_dir", root / "run" / "ckpt")
    assert checkpoint_dirs(root / "run" / "ckpt") == ["epoch_0_step_2", "epoch_0_step_4"]
    return {"config": config, "run": root / "run"}


def _copy(finished, tmp_path: Path) -> Path:
    shutil.copytree(finished["run"], tmp_path, dirs_exist_ok=True)
    return tmp_path / "ckpt"


def _main(config, *args, capsys) -> tuple[int, str]:
    from automodel.cli.main import main

    capsys.readouterr()
    rc = main(["finetune", "llm", "-c", str(config), *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _past_the_end(path: Path) -> None:
    state = json.loads(path.read_text())
    state["state"]["_num_yielded"] = 1000
    path.write_text(json.dumps(state))


DAMAGE = {
    "trainer_state.json": (lambda c: (c / "trainer_state.json").write_text('{"step": 4, "ep'),
                           r"epoch_0_step_4/trainer_state.json' is corrupted \(JSONDecodeError"),
    "step of 10^30": (lambda c: (c / "trainer_state.json").write_text(json.dumps(
        {**json.loads((c / "trainer_state.json").read_text()), "step": 10**30})),
        r"trainer_state.json' is damaged: 'step' must be an integer from 0 to 1000000000000"),
    "rng state": (lambda c: (c / "rng" / "rank_0.json").write_text("\x00garbage"),
                  r"rng/rank_0.json' is corrupted"),
    "rng tensors": (lambda c: _truncate(c / "rng" / "rank_0.safetensors"), r"rng/rank_0.safetensors' is corrupted"),
    "optimizer manifest": (lambda c: (c / "optim" / "optimizer.json").write_text("[1, 2"),
                     r"optim/optimizer.json' is corrupted"),
    "weights": (lambda c: _truncate(c / "model" / "model.safetensors"), r"model/model.safetensors' is corrupted"),
    "optimizer shard": (lambda c: _truncate(next((c / "optim").glob("shard-*.safetensors"))),
                        r"cannot read '.*optim/shard-00001-model-00001-of-00001.safetensors' as a checkpoint shard"),
    "data position": (lambda c: _past_the_end(c / "dataloader" / "rank_0.json"),
                      r"dataloader/rank_0.json': its data position is past the end of the data"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_naming_the_file(case, finished, tmp_path, monkeypatch, capsys, inprocess):
    root = _copy(finished, tmp_path)
    damage, message = DAMAGE[case]
    damage(root / "epoch_0_step_4")
    before = sorted(p.name for p in root.iterdir())
    monkeypatch.chdir(tmp_path)
    rc, text = _main(finished["config"], *MORE, capsys=capsys)
    assert rc == 1, text
    assert "Traceback" not in text
    assert re.search(message, text), text
    assert "--restore_from.path" in text  # what to do
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written, replaced or retired
    assert (root / "LATEST").read_text().strip() == "epoch_0_step_4"


@pytest.mark.parametrize("name", ["../x", "/etc", "a/b"])
def test_latest_naming_something_outside_is_refused(name, finished, tmp_path, monkeypatch, capsys, inprocess):
    root = _copy(finished, tmp_path)
    (root / "LATEST").write_text(name + "\n")
    monkeypatch.chdir(tmp_path)
    rc, text = _main(finished["config"], capsys=capsys)
    assert rc == 1 and "Traceback" not in text, text
    assert f"LATEST' names '{name}', which is not a checkpoint directory inside" in text
    assert checkpoint_dirs(root) == ["epoch_0_step_2", "epoch_0_step_4"]


def test_rerunning_a_finished_run_reports_it_complete_and_writes_nothing(finished, tmp_path, monkeypatch, capsys,
                                                                       inprocess):
    root = _copy(finished, tmp_path)
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.name != ".lock"}
    monkeypatch.chdir(tmp_path)
    rc, text = _main(finished["config"], capsys=capsys)
    assert rc == 0, text
    assert "resuming from ckpt/epoch_0_step_4: checkpoint.checkpoint_dir already holds a run" in text
    assert "choose a new checkpoint.checkpoint_dir" in text
    assert "the run is complete: ckpt/epoch_0_step_4 is at step 4" in text
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.name != ".lock"} == stamps  # weights untouched


def test_restore_latest_in_any_case_on_an_empty_directory_starts_fresh(finished, tmp_path, monkeypatch, capsys,
                                                                     inprocess):
    monkeypatch.chdir(tmp_path)
    rc, text = _main(finished["config"], "--restore_from.path", "LATEST", capsys=capsys)
    assert rc == 0, text
    assert "note: restore_from.path: latest: no checkpoint under 'ckpt' yet; starting fresh" in text
    assert [r["step"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [1, 2, 3, 4]
    assert read_jsonl(tmp_path / "ckpt" / "training.jsonl") == \
        [{**row, "timestamp": r["timestamp"], "tps": r["tps"], "mem": r["mem"]}
         for row, r in zip(read_jsonl(finished["run"] / "ckpt" / "training.jsonl"),
                           read_jsonl(tmp_path / "ckpt" / "training.jsonl"), strict=True)]


def test_a_stateless_optimizer_resumes(finished, tmp_path, monkeypatch, capsys, inprocess):
    monkeypatch.chdir(tmp_path)
    sgd = ("--optimizer._target_", "torch.optim.SGD", "--optimizer.lr", "0.1", "--optimizer.weight_decay", "0")
    assert _main(finished["config"], *sgd, "--checkpoint.checkpoint_dir", "one", capsys=capsys)[0] == 0
    rc, text = _main(finished["config"], *sgd, *MORE, "--checkpoint.checkpoint_dir", "one", capsys=capsys)
    assert rc == 0, text
    assert _main(finished["config"], *sgd, *MORE, "--checkpoint.checkpoint_dir", "straight", capsys=capsys)[0] == 0
    assert read_jsonl(tmp_path / "one" / "training.jsonl") == [
        {**row, "timestamp": r["timestamp"], "tps": r["tps"], "mem": r["mem"]}
        for row, r in zip(read_jsonl(tmp_path / "straight" / "training.jsonl"),
                          read_jsonl(tmp_path / "one" / "training.jsonl"), strict=True)]


def test_a_second_concurrent_run_is_refused_and_a_killed_holder_blocks_nothing(finished, tmp_path, monkeypatch,
                                                                                capsys, inprocess):
    monkeypatch.chdir(tmp_path)
    first = h.start_cli("finetune", "llm", "-c", finished["config"], cwd=tmp_path, log=tmp_path / "first.log",
                        OMP_NUM_THREADS="1", AMT_FAULT_PAUSE="step:3", AMT_FAULT_MARKER=str(tmp_path / "paused"))
    try:
        h.wait_for((tmp_path / "paused").exists, first, what="step 3 of the first run")
        rc, text = _main(finished["config"], capsys=capsys)
        assert rc == 1 and "Traceback" not in text, text
        assert f"checkpoint.checkpoint_dir: 'ckpt' is in use by another run (pid {first.pid} on host " \
               f"{socket.gethostname()}); wait for it to finish, or give this run another checkpoint.checkpoint_dir" \
               in text
        assert [r["step"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [1, 2]  # not mixed
        first.send_signal(signal.SIGKILL)
    finally:
        h.finish(first)
    rc, text = _main(finished["config"], capsys=capsys)  # the same command: the dead holder's lock is gone
    assert rc == 0, text
    assert [r["step"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [1, 2, 3, 4]
