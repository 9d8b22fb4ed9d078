"""A crash while writing a checkpoint leaves the previous one and LATEST intact and usable (DESIGN §10)."""

from __future__ import annotations

import json

import pytest

from automodel.testing import assert_states_equal, checkpoint_dirs, load_safetensors_state, read_jsonl, train_inprocess

RUN = {"step_scheduler": {"max_steps": 4, "checkpoint_interval": 2}}


def crash_in_state_file(monkeypatch, error):
    """The step-4 checkpoint's second state file cannot be written (its first one already is)."""
    from automodel.training import state_files

    real, calls = state_files.write_durable, []

    def write(path, data):
        if "epoch_0_step_4" in str(path):
            calls.append(str(path))
            if len(calls) == 2:
                raise error
        return real(path, data)

    monkeypatch.setattr(state_files, "write_durable", write)
    return calls


def crash_in_export(monkeypatch, error):
    """The step-4 checkpoint's streaming export leaves a truncated weights file, then raises."""
    from automodel.training import checkpoint_write

    real = checkpoint_write.export_hf

    def export(directory, out, *args, **kwargs):
        if "epoch_0_step_4" in str(directory):
            out.mkdir(parents=True, exist_ok=True)
            (out / "model.safetensors").write_bytes(b"\x00" * 10)
            raise error
        return real(directory, out, *args, **kwargs)

    monkeypatch.setattr(checkpoint_write, "export_hf", export)


@pytest.mark.parametrize("where", ["state_file", "export"])
def test_crash_mid_checkpoint_keeps_previous(where, make_config, tmp_path, monkeypatch):
    from automodel.training.checkpoint import CheckpointError
    from automodel.training.parallel.shard_files import read_slices

    config = make_config(**RUN)
    root = tmp_path / "ckpt"
    if where == "state_file":  # a full disk: reported as a CheckpointError that says the previous one is intact
        calls = crash_in_state_file(monkeypatch, OSError(28, "No space left on device"))
        with pytest.raises(CheckpointError, match="intact"):
            train_inprocess(config)
        assert len(calls) == 2 and "/epoch_0_step_4/" not in calls[0], calls  # written aside, not in place
    else:  # any other failure propagates unchanged
        crash_in_export(monkeypatch, RuntimeError("killed mid-save"))
        with pytest.raises(RuntimeError, match="killed mid-save"):
            train_inprocess(config)
    monkeypatch.undo()

    # Only the complete step-2 checkpoint exists; nothing half-written under any name.
    assert checkpoint_dirs(root) == ["epoch_0_step_2"]
    assert (root / "LATEST").read_text().strip() == "epoch_0_step_2"
    leftovers = [p.name for p in root.iterdir() if p.name not in ("epoch_0_step_2", "LATEST", "training.jsonl",
                                                                   "validation.jsonl", ".lock")]
    assert leftovers == [], leftovers
    assert [r["step"] for r in read_jsonl(root / "training.jsonl")] == [1, 2, 3, 4]

    # ... and it is usable: plain transformers loads it, and the same command again continues from it.
    from transformers import AutoModelForCausalLM

    ckpt = root / "epoch_0_step_2"
    model = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    saved = load_safetensors_state(ckpt / "model")  # tied lm_head is stored once, as the embedding
    assert_states_equal({k: v for k, v in model.state_dict().items() if k in saved}, saved)
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 2
    read_slices(ckpt / "optim")
    recipe = train_inprocess(config)
    assert recipe.step_scheduler.step == 4
    assert checkpoint_dirs(root) == ["epoch_0_step_2", "epoch_0_step_4"]
    assert (root / "LATEST").read_text().strip() == "epoch_0_step_4"
    assert [r["step"] for r in read_jsonl(root / "training.jsonl")] == [1, 2, 3, 4]  # each step once
