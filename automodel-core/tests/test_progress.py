"""Progress on a terminal (tqdm) and elsewhere (plain lines); internal tuning lines only with AUTOMODEL_DEBUG=1."""

from __future__ import annotations

import io
import platform
import re

import pytest
import torch

from automodel.testing import ToyRecipe, train_inprocess
from automodel.training.progress import Progress, TaskProgress

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_tqdm_and_a_file_gets_lines():
    on_terminal, in_file = Terminal(), io.StringIO()
    for stream in (on_terminal, in_file):
        progress = Progress(4, 0, stream=stream)
        for step in range(4):
            progress.update()
            if step % 2:
                progress.show(1.5, 1e-3, 100.0)
        progress.close()
    assert "\r" in on_terminal.getvalue() and "train: 100%" in on_terminal.getvalue()
    assert "\r" not in in_file.getvalue()
    assert [line.split(":")[0] for line in in_file.getvalue().splitlines()] == ["train step 2/4", "train step 4/4"]
    silent = io.StringIO()
    Progress(4, 0, enabled=False, stream=silent).show(1.0, 1.0, 1.0)
    assert silent.getvalue() == ""


def test_resumed_progress_counts_from_the_restored_step():
    stream = io.StringIO()
    progress = Progress(10, 6, stream=stream)
    assert progress.eta() is None
    progress.update(2)
    progress.show(1.0, 1e-3, 10.0)
    assert stream.getvalue().startswith("train step 8/10: ")
    assert progress.eta() is not None and progress.eta() >= 0  # 2 steps left, at the pace of the 2 done here


def test_task_progress_is_one_line_when_it_ends():
    stream = io.StringIO()
    with TaskProgress(30, "embed corpus", unit="text", stream=stream) as bar:
        for _ in range(3):
            bar.update(10)
    assert re.fullmatch(r"embed corpus: 30 texts in 0:00:\d\d\n", stream.getvalue())
    terminal = Terminal()
    with TaskProgress(30, "search", unit="pair", stream=terminal) as bar:
        bar.update(30)
    assert "\r" in terminal.getvalue() and "search: 100%" in terminal.getvalue()


@pytest.mark.skipif(not GLIBC, reason="the malloc tuning line exists on glibc only")
@pytest.mark.parametrize("debug", [False, True])
def test_the_malloc_tuning_line_is_a_debug_line(debug, make_toy, monkeypatch, capsys):
    if debug:
        monkeypatch.setenv("AUTOMODEL_DEBUG", "1")
    else:
        monkeypatch.delenv("AUTOMODEL_DEBUG", raising=False)
    train_inprocess(make_toy(), recipe=ToyRecipe, setup_only=True)
    assert ("host memory: glibc malloc maps blocks" in capsys.readouterr().err) is debug


@pytest.mark.skipif(torch.cuda.is_available(), reason="the note is for runs without a GPU")
@pytest.mark.parametrize("pin", [False, True])
def test_pin_memory_without_a_gpu_is_named_as_governing_nothing(pin, make_toy, capsys):
    train_inprocess(make_toy(dataloader={"pin_memory": pin}), recipe=ToyRecipe, setup_only=True)
    assert ("note: dataloader.pin_memory: true governs nothing this run" in capsys.readouterr().err) is pin
