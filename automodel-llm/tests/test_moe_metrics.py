"""``moe_metrics:`` (upstream's expert load metrics): the metrics of known loads; a tiny Qwen3-MoE through the CLI
logs them with each step, balanced routing gives balanced metrics, validation forwards do not count, and two
expert-parallel ranks (each its half of the batch) log the one process's values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from llm_testing import VALIDATION, fsdp2_ranks_with, write_config, write_tiny_moe_config

from automodel.testing import free_port, read_jsonl, run_cli
from automodel.training.expert_load import load_metrics

STEPS = ["--step_scheduler.max_steps", "3", "--dataloader.batch_size", "2", "--dataloader.shuffle", "false"]
MOE_METRICS = {"enabled": True, "mode": "detailed", "top_k_experts": 1}


def test_metrics_of_known_loads():
    metrics = load_metrics([torch.tensor([6.0, 2.0, 0.0, 0.0]), torch.tensor([2.0, 2.0, 2.0, 2.0])], detailed=True,
                           top_k=1)
    assert metrics["moe/layer_0/cv"] == pytest.approx(math.sqrt(6.0) / 2)  # population std over the mean 2
    assert metrics["moe/layer_1/cv"] == 0.0 and metrics["moe/cv_max"] == pytest.approx(math.sqrt(6.0) / 2)
    assert metrics["moe/expert_utilization_max"] == 3.0 and metrics["moe/expert_utilization_min"] == 0.0
    assert metrics["moe/dead_expert_frac_mean"] == 0.25 and metrics["moe/layer_0/dead_expert_frac"] == 0.5
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert metrics["moe/layer_0/expert_diversity"] == pytest.approx(math.exp(entropy) / 4)
    assert metrics["moe/layer_1/expert_diversity"] == pytest.approx(1.0)
    assert metrics["moe_expert_utilization/layer_0_expert_0"] == 3.0  # the most loaded expert
    assert metrics["moe_expert_utilization/layer_0_expert_3"] == 0.0  # the least loaded one
    assert not any("layer_" in key for key in load_metrics([torch.ones(4)]))  # brief: aggregates only


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory) -> Path:
    return write_tiny_moe_config(tmp_path_factory.mktemp("tiny_moe"))


def _run(config: Path, cwd: Path, directory: Path, *args) -> list[dict]:
    port = ["--master-port", str(free_port())] if "--nproc-per-node" in args else []
    result = run_cli("finetune", "llm", "-c", config, *STEPS, *args, *port, "--checkpoint.checkpoint_dir", directory,
                     cwd=cwd, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "moe_metrics: the load of the experts of 2 mixture-of-experts layers logged with each step" in \
        result.stderr
    return [{k: v for k, v in row.items() if k.startswith("moe")} for row in read_jsonl(directory / "training.jsonl")]


@pytest.mark.slow
def test_the_steps_log_the_experts_load_over_all_ranks_and_training_forwards_only(moe_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", moe_config, tmp_path / "ckpt", moe_metrics=MOE_METRICS)
    one = _run(config, tmp_path, tmp_path / "one", "--step_scheduler.grad_accumulation_steps", "2")
    assert len(one) == 3 and {"moe/cv_mean", "moe/layer_1/expert_diversity",
                              "moe/expert_utilization_max"} <= one[0].keys()
    assert 0.0 < one[0]["moe/expert_diversity_min"] <= 1.0 and one[0]["moe/expert_utilization_max"] > 1.0
    validated = write_config(tmp_path / "val.yaml", moe_config, tmp_path / "ckpt", moe_metrics=MOE_METRICS,
                             validation_dataset=VALIDATION, step_scheduler={"val_check_interval": 1})
    assert _run(validated, tmp_path, tmp_path / "val", "--step_scheduler.grad_accumulation_steps", "2") == one
    ep2 = _run(config, tmp_path, tmp_path / "ep2", *fsdp2_ranks_with("ep_size"))  # each rank half of each step
    assert ep2[0] == pytest.approx(one[0], rel=1e-9)  # the same model at step 1: the same routing
    assert ep2[0].keys() == one[0].keys()


def test_balanced_routing_logs_balanced_loads(moe_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", moe_config, tmp_path / "ckpt", moe_metrics={"enabled": True})
    rows = _run(config, tmp_path, tmp_path / "out", "--model.backend.fake_balanced_gate", "true")
    for row in rows:
        assert row["moe/cv_max"] == 0.0 and row["moe/dead_expert_frac_mean"] == 0.0
        assert row["moe/expert_utilization_min"] == row["moe/expert_utilization_max"] == 1.0
        assert row["moe/expert_diversity_min"] == pytest.approx(1.0)
        assert not any("layer_" in key for key in row)  # brief


def test_a_model_without_experts_is_refused(tmp_path):
    from llm_testing import write_tiny_llama_config

    config = write_config(tmp_path / "cfg.yaml", write_tiny_llama_config(tmp_path), tmp_path / "ckpt",
                          moe_metrics={"enabled": True})
    result = run_cli("finetune", "llm", "-c", config, *STEPS, cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "moe_metrics.enabled: LlamaForCausalLM has no mixture-of-experts layer" in result.stderr


def test_pipeline_parallelism_is_refused(moe_config, tmp_path):
    from llm_testing import validate_cli

    config = write_config(tmp_path / "cfg.yaml", moe_config, tmp_path / "ckpt", moe_metrics={"enabled": True},
                          distributed={"strategy": "fsdp2", "pp_size": 2})
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2")
    assert code == 2 and "moe_metrics.enabled: true with pp_size 2: a step's record is written by the first " \
                         "stage's rank" in out
