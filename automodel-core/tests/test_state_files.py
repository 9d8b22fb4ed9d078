"""State files: every state besides the weights as JSON + safetensors, read back exactly and never unpickled; a
damaged file is refused naming it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from automodel.training.rng import StatefulRNG
from automodel.training.state_files import StateFileError, read_state, write_state


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here


def test_nested_states_round_trip_exactly(tmp_path):
    state = {"state": {0: {"step": torch.tensor(3.0), "buf": torch.randn(2, 3)}, 1: {}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "foreach": None}],
             "keys": np.arange(5, dtype=np.uint32), "blob": b"\x00\xff", "big": 2**63 + 5, "nan": float("nan"),
             "__tensor__": "a plain key that looks like a marker", "nested": [[1, (2, 3)], {"x": True}],
             (1, 2): "a tuple key", "seed": np.int64(7)}
    files = write_state(tmp_path / "opt", state, "'optimizer'")
    assert sorted(f.name for f in files) == ["opt.json", "opt.safetensors"]
    loaded = read_state(tmp_path / "opt")
    assert loaded.pop("seed") == 7
    state.pop("seed")
    assert _same(state, loaded), loaded


def test_rng_state_round_trips_through_the_files(tmp_path):
    rng = StatefulRNG(seed=5)
    write_state(tmp_path / "rng", rng.state_dict(), "'rng'")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    StatefulRNG(seed=99).load_state_dict(read_state(tmp_path / "rng"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_state_that_is_not_data_is_refused_when_saved(tmp_path):
    with pytest.raises(StateFileError, match=r"cannot save the state of 'lr_scheduler': '.lr_lambdas\[0\]' is a "
                                             "function"):
        write_state(tmp_path / "s", {"lr_lambdas": [lambda step: 1.0]}, "'lr_scheduler'")


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "s.json").write_text('{"format": 1, "state": {"a": '), r"s.json' is corrupted \(JSONDecodeError"),
    (lambda d: (d / "s.json").write_text('{"state": 1}'), "s.json' is not a state file written by automodel"),
    (lambda d: (d / "s.json").write_text(json.dumps({"format": 1, "state": {"__tensor__": "9"}})),
     r"s.json' is corrupted \(it refers to tensor '9'"),
    (lambda d: (d / "s.json").write_text(json.dumps({"format": 1, "state": {"__dict__": [[[1], 2]]}})),
     "a mapping has a key that cannot be a key"),
    (lambda d: (d / "s.safetensors").write_bytes((d / "s.safetensors").read_bytes()[:40]),
     r"s.safetensors' is corrupted"),
    (lambda d: (d / "s.json").unlink(), r"s.json' is missing"),
])
def test_a_damaged_state_file_is_named(damage, message, tmp_path):
    write_state(tmp_path / "s", {"t": torch.ones(64)}, "'x'")
    damage(tmp_path)
    with pytest.raises(StateFileError, match=message):
        read_state(tmp_path / "s")
