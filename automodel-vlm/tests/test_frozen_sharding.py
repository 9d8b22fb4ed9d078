"""``distributed.multimodal.frozen_sharding`` through the CLI on two CPU ranks (gloo, FSDP2) with the tiny Llava's
vision tower frozen: each of root / per_layer / replicate trains with the one process's losses, the run's sharding
line (read from the sharded model) shows where the tower went, and the consolidated ``model/`` loads with
transformers as the one process's weights (replicate's from its sharded checkpoint, which holds the tower whole,
once, exported); bad values are refused by ``automodel validate``; one process notes that the settings govern
nothing.

The data is unshuffled and the one process accumulates two micro-batches, so each step sees the two ranks' rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vlm_testing import LLAVA_CONFIG, train_inprocess, write_config

from automodel.testing import free_port, read_jsonl, run_cli

# with the end-of-run generation (transformers' generate runs the image encoder outside the model's forward)
THREE_STEPS = {"step_scheduler": {"max_steps": 3, "val_check_interval": 100, "checkpoint_interval": 3},
               "validation_dataset": {"limit_dataset_samples": 4}, "dataset": {"limit_dataset_samples": 24},
               "eval_generation": {"enabled": True, "num_examples": 4, "num_shown": 4, "max_new_tokens": 3},
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


def _answers(log: str) -> list[str]:
    return [line.strip() for line in log.splitlines() if "expected:" in line]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("one"), "one", "--step_scheduler.grad_accumulation_steps", "2")


@pytest.mark.parametrize("setting", [pytest.param("root", marks=pytest.mark.slow), "per_layer",
                                     pytest.param("replicate", marks=pytest.mark.slow)])
def test_each_setting_trains_like_one_process_and_places_the_frozen_tower(one_process, tmp_path, setting):
    """Also the answers of the end-of-run generation, which every rank runs with the root's weights gathered."""
    one_process, one_log = one_process
    sharded = ["--checkpoint.save_consolidated", "false"] if setting == "replicate" else []
    out, log = _train(tmp_path, setting, *TWO, *sharded, distributed={"multimodal": {"frozen_sharding": setting}})
    assert TOWER[setting] in log
    assert "model.multi_modal_projector trains: sharded by blocks whatever frozen_sharding says, 1 units" in log
    assert "2 blocks sharded" in log  # the language model's layers, never the tower's
    assert _losses(out) == pytest.approx(_losses(one_process), rel=1e-4)
    assert len(_answers(log)) == 4 and _answers(log) == _answers(one_log)
    saved = out / "epoch_0_step_3"
    model_dir = saved / "model"
    if setting == "replicate":  # the sharded form holds the tower whole, once; exported, it is the consolidated form
        from automodel.training.parallel.shard_files import read_slices

        shapes, slices = read_slices(saved / "model_shards")
        tower = [key for key in shapes if "vision_tower" in key]
        assert len(tower) == 39 and all(len(slices[k]) == 1 and slices[k][0].shape == shapes[k] for k in tower)
        model_dir = tmp_path / "exported"
        assert run_cli("export", saved, model_dir, cwd=tmp_path).returncode == 0
    got, expected = _weights(model_dir), _weights(one_process / "epoch_0_step_3" / "model")
    assert got.keys() == expected.keys() and expected
    for key, value in expected.items():
        assert (got[key] - value).abs().max().item() < 1e-5, key


def _validate(capsys, config: Path, *args: str) -> tuple[int, str]:
    from automodel.cli.main import main

    code = main(["validate", "-c", str(config), *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_bad_values_are_refused_with_the_allowed_ones(tmp_path, capsys):
    frames = {"enabled": "yes", "mesh_dims": ["cp"], "min_tokenz": 0, "min_frames": -1, "cost_alpha": "big"}
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", distributed={
        "strategy": "fsdp2", "multimodal": {"frozen_sharding": "sharded", "vision": {"frame_sharding": frames}}})
    code, out = _validate(capsys, config, "--nproc-per-node", "2")
    assert code == 2 and "Traceback" not in out
    assert "distributed.multimodal.frozen_sharding: 'sharded': must be one of root, per_layer, replicate" in out
    assert "distributed.multimodal.vision.frame_sharding.enabled: 'yes': must be true or false" in out
    assert "distributed.multimodal.vision.frame_sharding.min_frames: -1: must be a whole number >= 0" in out
    assert "distributed.multimodal.vision.frame_sharding.cost_alpha: 'big': must be auto" in out
    assert "distributed.multimodal.vision.frame_sharding: min_tokenz: not a key of upstream's" in out
    code, out = _validate(capsys, config, "--nproc-per-node", "2", "--distributed.strategy", "megatron_fsdp",
                          "--distributed.multimodal", "{frozen_sharding: Per-Layer}")
    assert code == 2 and "Megatron-FSDP shards the model its own way" in out


def test_in_one_process_the_settings_govern_nothing_and_say_so(tmp_path, capsys):
    frames = {"enabled": False, "mesh_dims": ["cp"], "min_tokens": 0}
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", **THREE_STEPS, distributed={
        "multimodal": {"frozen_sharding": "replicate", "vision": {"frame_sharding": frames}}})
    train_inprocess(config, setup_only=True)
    out = capsys.readouterr().err
    assert "note: distributed.multimodal.frozen_sharding: replicate governs nothing this run" in out
    assert "note: distributed.multimodal.vision.frame_sharding governs nothing this run: it is off" in out
    frames["enabled"] = True
    config = write_config(tmp_path / "on.yaml", tmp_path / "on", **THREE_STEPS, distributed={
        "multimodal": {"vision": {"frame_sharding": frames}}})
    train_inprocess(config, setup_only=True)
    assert "frame_sharding governs nothing this run: it splits the vision encoder's frames over the " \
           "context-parallel ranks (cp_size > 1); with cp_size 1" in capsys.readouterr().err


_SHARDED_NAMES = """
import json, os, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlavaConfig, LlavaForConditionalGeneration
from automodel.training.parallel.fsdp import apply_fsdp2
from automodel.training.parallel.hf_export import export_names

dist.init_process_group("gloo")
model = LlavaForConditionalGeneration(LlavaConfig(**json.loads(open(sys.argv[1]).read())))
plain = export_names(model)
apply_fsdp2(model, init_device_mesh("cpu", (1,)))
print(json.dumps([plain, export_names(model)]))
dist.destroy_process_group()
"""


def test_a_sharded_llava_is_saved_under_the_names_transformers_writes(tmp_path):
    """FSDP2's wrapper classes hid the Llava from transformers' renaming, so a sharded run's model/ held keys like
    ``model.language_model.model.x`` that no resume could read (the names the one-process save_pretrained writes
    are ``language_model.model.x``)."""
    env = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    result = subprocess.run([sys.executable, "-c", _SHARDED_NAMES, str(LLAVA_CONFIG)], capture_output=True,
                            text=True, cwd=tmp_path, env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    plain, sharded = json.loads(result.stdout.strip().splitlines()[-1])
    assert sharded == plain
    assert plain[1]["model.language_model.embed_tokens.weight"] == "language_model.model.embed_tokens.weight"
