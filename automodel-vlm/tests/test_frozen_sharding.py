"""``distributed.multimodal.frozen_sharding`` through the CLI on two CPU ranks (gloo, FSDP2) with the tiny Llava's
vision tower frozen: each of root / per_layer / replicate trains with the one process's losses, the run's sharding
line (read from the sharded model) shows where the tower went, and the consolidated ``model/`` loads with
transformers as the one process's weights; replicate's sharded checkpoint (the tower whole, written once) resumes
on two ranks with the one process's next loss and weights; a bad value is refused by ``automodel validate``.

The data is unshuffled and the one process accumulates two micro-batches, so each step sees the two ranks' rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vlm_testing import write_config

from automodel.testing import free_port, read_jsonl, run_cli

THREE_STEPS = {"step_scheduler": {"max_steps": 3, "val_check_interval": 100, "checkpoint_interval": 3},
               "validation_dataset": None, "eval_generation": None, "dataset": {"limit_dataset_samples": 24},
               "dataloader": {"batch_size": 4, "shuffle": False}, "freeze": {"vision_tower": True}}
TWO = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2"]
# the sharding line's part for the frozen tower (2 CLIP layers, 39 parameter tensors) under each setting
TOWER = {"root": "model.vision_tower frozen: root, 0 units, 39 of 39 parameter tensors sharded",
         "per_layer": "model.vision_tower frozen: per_layer, 2 units, 39 of 39 parameter tensors sharded",
         "replicate": "model.vision_tower frozen: replicate, 0 units, 0 of 39 parameter tensors sharded"}


def _train(tmp: Path, name: str, *args: str, **sections: Any) -> tuple[Path, str]:
    out = tmp / name
    config = write_config(tmp / f"{name}.yaml", out, **{**THREE_STEPS, **sections})
    port = ["--master-port", str(free_port())] if "--nproc-per-node" in args else []
    result = run_cli("finetune", "vlm", "-c", config, *args, *port, cwd=tmp, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result.stderr


def _losses(out: Path) -> list[float]:
    return [row["loss"] for row in read_jsonl(out / "training.jsonl")]


def _weights(model_dir: Path) -> dict:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(model_dir).state_dict()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Four steps (checkpoints at 3 and 4): the reference of the three-step runs and of the resumed one."""
    return _train(tmp_path_factory.mktemp("one"), "one", "--step_scheduler.grad_accumulation_steps", "2",
                  "--step_scheduler.max_steps", "4")[0]


def _same_weights(model_dir: Path, reference: Path) -> None:
    got, expected = _weights(model_dir), _weights(reference)
    assert got.keys() == expected.keys() and expected
    for key, value in expected.items():
        assert (got[key] - value).abs().max().item() < 1e-5, key


@pytest.mark.parametrize("setting", ["root", "per_layer", "replicate"])
def test_each_setting_trains_like_one_process_and_places_the_frozen_tower(one_process, tmp_path, setting):
    sharded = ["--checkpoint.save_consolidated", "false"] if setting == "replicate" else []
    out, log = _train(tmp_path, setting, *TWO, *sharded, distributed={"multimodal": {"frozen_sharding": setting}})
    assert TOWER[setting] in log
    assert "model.multi_modal_projector trains: sharded by blocks whatever frozen_sharding says, 1 units" in log
    assert "2 blocks sharded" in log  # the language model's layers, never the tower's
    assert _losses(out) == pytest.approx(_losses(one_process)[:3], rel=1e-4)
    if setting != "replicate":
        _same_weights(out / "epoch_0_step_3" / "model", one_process / "epoch_0_step_3" / "model")
        return
    from automodel.training.parallel.shard_files import read_slices

    shapes, slices = read_slices(out / "epoch_0_step_3" / "model_shards")
    tower = [key for key in shapes if "vision_tower" in key]
    assert len(tower) == 39 and all(len(slices[k]) == 1 and slices[k][0].shape == shapes[k] for k in tower)
    restore = ["--restore_from.path", str(out / "epoch_0_step_3"), "--step_scheduler.max_steps", "4"]
    again, _ = _train(tmp_path, "again", *TWO, *restore, distributed={"multimodal": {"frozen_sharding": setting}})
    assert [row["step"] for row in read_jsonl(again / "training.jsonl")] == [4]
    assert _losses(again) == pytest.approx(_losses(one_process)[3:], rel=1e-4)
    _same_weights(again / "epoch_1_step_4" / "model", one_process / "epoch_1_step_4" / "model")


def test_a_bad_value_is_refused_with_the_allowed_ones(tmp_path):
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt",
                          distributed={"strategy": "fsdp2", "multimodal": {"frozen_sharding": "sharded"}})
    result = run_cli("validate", "-c", config, "--nproc-per-node", "2", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in out
    assert "distributed.multimodal.frozen_sharding" in out and "root, per_layer, replicate" in out
