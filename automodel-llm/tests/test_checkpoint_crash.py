"""A crash while writing a checkpoint leaves the previous one and LATEST intact and usable (DESIGN §10)."""

from __future__ import annotations

import json

import pytest
import torch

from automodel.testing import assert_states_equal, checkpoint_dirs, load_safetensors_state, read_jsonl, train_inprocess

RUN = {"step_scheduler": {"max_steps": 4, "checkpoint_interval": 2}}


def crash_in_torch_save(monkeypatch, error):
    """torch.save raises on its second call for the step-4 checkpoint (its first state file already written)."""
    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        if "epoch_0_step_4" in str(f):
            calls.append(str(f))
            if len(calls) == 2:
                raise error
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return calls


def crash_in_save_model(monkeypatch, error):
    """The recipe's save_model writes a truncated weights file for the second checkpoint, then raises."""
    from automodel.training.recipe import TrainRecipe

    real, calls = TrainRecipe.save_model, {"n": 0}

    def save_model(self, directory, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "model.safetensors").write_bytes(b"\x00" * 10)
            raise error
        return real(self, directory, *args, **kwargs)

    monkeypatch.setattr(TrainRecipe, "save_model", save_model)


@pytest.mark.parametrize("where", ["torch_save", "save_model"])
def test_crash_mid_checkpoint_keeps_previous(where, make_config, tmp_path, monkeypatch):
    from automodel.training.checkpoint import CheckpointError

    config = make_config(**RUN)
    root = tmp_path / "ckpt"
    if where == "torch_save":  # a full disk: reported as a CheckpointError that says the previous one is intact
        calls = crash_in_torch_save(monkeypatch, OSError(28, "No space left on device"))
        with pytest.raises(CheckpointError, match="intact"):
            train_inprocess(config)
        assert len(calls) == 2 and "/epoch_0_step_4/" not in calls[0], calls  # written aside, not in place
    else:  # any other failure propagates unchanged
        crash_in_save_model(monkeypatch, RuntimeError("killed mid-save"))
        with pytest.raises(RuntimeError, match="killed mid-save"):
            train_inprocess(config)
    monkeypatch.undo()

    # Only the complete step-2 checkpoint exists; nothing half-written under any name.
    assert checkpoint_dirs(root) == ["epoch_0_step_2"]
    assert (root / "LATEST").read_text().strip() == "epoch_0_step_2"
    leftovers = [p.name for p in root.iterdir() if p.name not in ("epoch_0_step_2", "LATEST", "training.jsonl",
                                                                   "validation.jsonl")]
    assert leftovers == [], leftovers
    assert [r["step"] for r in read_jsonl(root / "training.jsonl")] == [1, 2, 3, 4]

    # ... and it is usable: plain transformers loads it, and a run restored from `latest` finishes.
    from transformers import AutoModelForCausalLM

    ckpt = root / "epoch_0_step_2"
    model = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    saved = load_safetensors_state(ckpt / "model")  # tied lm_head is stored once, as the embedding
    assert_states_equal({k: v for k, v in model.state_dict().items() if k in saved}, saved)
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 2
    for file in (ckpt / "optim").glob("*.pt"):
        torch.load(file, weights_only=True)
    recipe = train_inprocess(config, "--restore_from.path", "latest")
    assert recipe.step_scheduler.step == 4
    assert checkpoint_dirs(root) == ["epoch_0_step_2", "epoch_0_step_4"]
    assert (root / "LATEST").read_text().strip() == "epoch_0_step_4"
    assert [r["step"] for r in read_jsonl(root / "training.jsonl")] == [1, 2, 3, 4, 3, 4]
