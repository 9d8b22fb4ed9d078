"""Tensor parallelism of the VLM recipe through the CLI on CPU ranks (gloo): ``distributed.tp_size: 2`` on two ranks
shards the tiny Llava's language model (its projections, embedding and head by the text model's plan) with the
vision tower and projector replicated, and trains with the per-step losses and gradient norms of one process; its
consolidated ``model/`` loads with transformers as the one process's weights, and with LoRA the saved adapter is the
one process's; a tp_size the text model's heads do
not divide is refused by ``automodel validate`` with the numbers.

The two ranks of the tp group read the same rows, so the one-process reference has the same batch size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vlm_testing import LLAVA_CONFIG, assert_trains_like, write_config

from automodel.testing import free_port, run_cli

FOUR_STEPS = {"step_scheduler": {"max_steps": 4, "val_check_interval": 100, "checkpoint_interval": 4},
              "validation_dataset": None, "eval_generation": None, "dataset": {"limit_dataset_samples": 32}}
TP2 = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2", "--distributed.tp_size", "2"]


def _even_vocab_config(directory: Path) -> Path:
    """The tiny Llava with a vocabulary of 354 (the shipped 353 is odd; the plan shards the embedding and head)."""
    config = json.loads(LLAVA_CONFIG.read_text())
    config["text_config"]["vocab_size"] = 354
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


def _train(tmp: Path, name: str, *args: str, **sections: Any) -> tuple[Path, str]:
    out = tmp / name
    config = write_config(tmp / f"{name}.yaml", out, **{**FOUR_STEPS, **sections},
                          model={"config": str(_even_vocab_config(tmp))})
    port = ["--master-port", str(free_port())] if "--nproc-per-node" in args else []
    result = run_cli("finetune", "vlm", "-c", config, *args, *port, cwd=tmp, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result.stderr


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_tp2_trains_like_one_process(tmp_path, lora):
    sections = {"peft": {"dim": 4, "alpha": 8, "match_all_linear": True, "dropout": 0.0}} if lora else {}
    reference, _ = _train(tmp_path, "one", **sections)
    out, log = _train(tmp_path, "tp2", *TP2, **sections)
    assert "tensor parallel over tp 2" in log and "vocabulary-parallel loss" in log
    plan = log.split("tensor parallel over tp 2", 1)[1].split("\n")
    plan = [line.strip() for line in plan[1:] if line.startswith("  ") and ": " in line]
    sharded = "model.language_model.layers.*.self_attn.q_proj" + (".lora_B.default" if lora else "")
    assert f"{sharded}: colwise (column-wise: output features sharded) x 2" in plan
    assert not [line for line in plan if "vision_tower" in line or "projector" in line]  # replicated
    assert_trains_like(out, reference, "epoch_0_step_4", lora)


def test_a_tp_size_the_text_heads_do_not_divide_is_refused(tmp_path):
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", distributed={"strategy": "fsdp2", "tp_size": 3})
    result = run_cli("validate", "-c", config, "--nproc-per-node", "3", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in out
    assert "distributed.tp_size" in out and "attention heads (num_attention_heads = 4)" in out
    assert "vocabulary size (vocab_size = 353)" in out


def test_sequence_parallel_is_refused(tmp_path):
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt",
                          distributed={"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True})
    result = run_cli("validate", "-c", config, "--nproc-per-node", "2", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "distributed.sequence_parallel" in out
    assert "not implemented for vision-language models" in out


def test_dry_run_prints_the_language_models_plan_under_the_composite_names(tmp_path):
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", model={"config": str(_even_vocab_config(tmp_path))})
    result = run_cli("finetune", "vlm", "-c", config, *TP2, "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout + result.stderr
    assert "tensor parallel over tp 2, vocabulary-parallel loss" in out
    assert "model.language_model.layers.*.mlp.down_proj: rowwise (row-wise: input features sharded, output " \
           "all-reduced) x 2" in out
