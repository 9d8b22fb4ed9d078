"""automodel.testing.once_per_session: a session fixture's result computed once and shared by pytest-xdist workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel.testing import once_per_session


class _Factory:
    """What tmp_path_factory offers the helper: the session's base temp directory (a worker's own under xdist)."""

    def __init__(self, base: Path):
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def test_the_first_worker_computes_and_the_others_read_its_result(tmp_path, monkeypatch):
    session = tmp_path / "pytest-7"
    calls = []

    def compute(directory: Path) -> dict:
        calls.append(directory)
        (directory / "made.txt").write_text("x")
        return {"dir": directory, "losses": [1.5, 2.0], "nested": {"file": directory / "made.txt"}}

    results = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        base = session / f"popen-{worker}"
        base.mkdir(parents=True)
        results.append(once_per_session(_Factory(base), "scenario", compute))
    assert calls == [session / "scenario"]  # computed once, in the directory both workers share
    assert results[0] == results[1] == {"dir": session / "scenario", "losses": [1.5, 2.0],
                                        "nested": {"file": session / "scenario" / "made.txt"}}
    assert isinstance(results[1]["nested"]["file"], Path)


def test_without_xdist_it_uses_the_sessions_own_directory_and_refuses_what_json_cannot_hold(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert once_per_session(_Factory(tmp_path), "plain", lambda d: {"dir": d})["dir"] == tmp_path / "plain"
    with pytest.raises(TypeError, match="set is not JSON-able"):
        once_per_session(_Factory(tmp_path), "bad", lambda d: {"values": {1, 2}})
