"""Tensor parallelism of the VLM recipe through the CLI on CPU ranks (gloo): ``distributed.tp_size: 2`` on two ranks
shards the tiny Llava's language model (its projections, embedding and head by the text model's plan) with the
vision tower and projector replicated, and trains with the per-step losses and gradient norms of one process; its
consolidated ``model/`` loads with transformers as the one process's weights, and with LoRA the saved adapter is the
one process's; a tp_size the text model's heads do
not divide is refused by ``automodel validate`` with the numbers. A Gemma 4 with per-layer inputs keeps its
embedding and tied head whole over tp (its forward reads the embedding's rows).

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


def test_gemma4_per_layer_inputs_keep_the_embedding_and_its_tied_head_whole():
    """Gemma 4's per-layer inputs read rows of the language model's embedding weight in the model's own code (the
    pad token's, and every row to recover the ids): the plan leaves that embedding, and the head tied to it, whole on
    every tensor-parallel rank; without per-layer inputs (or untied) they keep transformers' vocabulary split."""
    import torch
    from transformers import AutoModelForImageTextToText
    from vlm_context_parallel_workers import tiny_model

    from automodel.training.parallel.tp_plans import model_plan

    def plan(per_layer: int, tied: bool = True) -> dict[str, str]:
        config = tiny_model("gemma4")[0].config
        config.text_config.hidden_size_per_layer_input = per_layer
        config.text_config.tie_word_embeddings = config.tie_word_embeddings = tied
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
        return {name: style for name, style in model_plan(model).items() if "embed" in name or "lm_head" in name}

    assert plan(8) == {}
    assert plan(8, tied=False) == {"lm_head": "colwise_gather_output"}
    assert plan(0) == {"lm_head": "colwise_gather_output", "model.language_model.embed_tokens": "embedding_rowwise"}


@pytest.mark.slow  # make test-slow: two ranks of the plan rule the test above checks
def test_a_gemma4_with_per_layer_inputs_trains_under_tp2_like_one_process(tmp_path):
    from vlm_testing import tiny_gemma4_dir

    model = tiny_gemma4_dir(tmp_path / "gemma4", num_key_value_heads=2)  # two key/value heads: one per rank
    runs = {}
    for name, args in (("one", []), ("tp2", [*TP2, "--master-port", str(free_port())])):
        # SGD: AdamW's update divides by the square root of each gradient, so the last bits of two sums' order
        # (tensor-parallel or not) grow into visible differences of the tiny entries within steps
        config = write_config(tmp_path / f"{name}.yaml", tmp_path / name, **FOUR_STEPS, processor=None,
                              model={"_target_": "automodel_vlm.AutoModelForImageTextToText.from_pretrained",
                                     "pretrained_model_name_or_path": str(model), "config": None, "seed": None},
                              optimizer={"_target_": "torch.optim.SGD", "lr": 0.05, "weight_decay": 0.0})
        result = run_cli("finetune", "vlm", "-c", config, *args, cwd=tmp_path, OMP_NUM_THREADS="1")
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = result.stderr
    assert "tensor parallel over tp 2" in runs["tp2"]
    from transformers import AutoModelForImageTextToText
    from vlm_testing import training_column

    for key in ("loss", "grad_norm"):
        one = training_column(tmp_path / "one", key)
        assert len(one) == 4 and training_column(tmp_path / "tp2", key) == pytest.approx(one, rel=1e-4), key
    saved = [AutoModelForImageTextToText.from_pretrained(tmp_path / name / "epoch_0_step_4" / "model").state_dict()
             for name in ("one", "tp2")]
    assert saved[0].keys() == saved[1].keys() and "model.language_model.embed_tokens_per_layer.weight" in saved[0]
    for key, value in saved[0].items():
        assert (saved[1][key] - value).abs().max().item() < 1e-5, key
