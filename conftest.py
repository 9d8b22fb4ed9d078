"""Every test runs in a working directory of its own (a fresh temporary one), never the repository's: a run that
uses a relative path (the default ``checkpoint_dir: checkpoints``, a config written as ``cfg.yaml``) then writes
there, so two pytest-xdist workers never share one run's directory (its lock) and nothing lands in the checkout.
Module and session fixtures run in a directory of their worker's own."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _worker_working_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(before)


@pytest.fixture(autouse=True)
def _test_working_directory(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
