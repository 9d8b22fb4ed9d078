"""Configs written in the upstream (NeMo AutoModel) schema run with only model and dataset paths overridden."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from llm_testing import SQUAD_DIR, TOKENIZER_DIR

from automodel.testing import checkpoint_dirs, read_jsonl, run_cli, run_cli_inprocess

CONFIGS = Path(__file__).parent / "upstream_configs"


@pytest.fixture(scope="module")
def local_model(tmp_path_factory, tiny_llama_config):
    """A tiny Llama saved like a hub checkpoint (weights + tokenizer)."""
    from transformers import AutoTokenizer

    from automodel_llm import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("model") / "tiny"
    AutoModelForCausalLM.from_config(str(tiny_llama_config), seed=0).save_pretrained(path)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(path)
    return path


@pytest.fixture
def prompt_completion(tmp_path):
    rows = [json.loads(line) for line in (SQUAD_DIR / "train.jsonl").read_text().splitlines()[:40]]
    paths = {}
    for split, part in (("train", rows[:32]), ("validation", rows[32:])):
        paths[split] = tmp_path / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps({"prompt": f"{r['context']} {r['question']}",
                                                    "completion": r["answers"]["text"][0]}) + "\n" for r in part))
    return paths


@pytest.mark.parametrize("command", [["finetune", "llm"], ["run"]])
def test_upstream_full_sft_config(command, local_model, tmp_path):
    result = run_cli(*command, "-c", CONFIGS / "squad_sft.yaml",
                     "--model.pretrained_model_name_or_path", local_model,
                     "--dataset.dataset_name", SQUAD_DIR, "--validation_dataset.dataset_name", SQUAD_DIR,
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoint_dirs(tmp_path / "checkpoints") == ["epoch_0_step_2", "epoch_0_step_4"]
    assert "validation [validation] step 4" in result.stderr


@pytest.mark.parametrize("command", [["finetune", "llm"], ["run"]])
def test_upstream_lora_config(command, local_model, prompt_completion, tmp_path):
    result = run_cli(*command, "-c", CONFIGS / "squad_lora.yaml",
                     "--model.pretrained_model_name_or_path", local_model,
                     "--dataset.path_or_dataset_id", prompt_completion["train"],
                     "--validation_dataset.path_or_dataset_id", prompt_completion["validation"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not validated and read by nothing in the run: 'ci'" in result.stderr  # named, not silently ignored
    final = (tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "LATEST").read_text().strip())
    assert (final / "model" / "adapter_model.safetensors").is_file()
    assert (final / "model" / "adapter_config.json").is_file()


def test_unsupported_upstream_key_is_reported_by_name(local_model, tmp_path):
    result = run_cli_inprocess("validate", "-c", CONFIGS / "squad_lora.yaml",
                               "--lr_scheduler.lr_decay_style", "polynomial",
                               "--model.pretrained_model_name_or_path", local_model, cwd=tmp_path)
    assert result.returncode == 2 and "lr_scheduler.lr_decay_style: 'polynomial' is not supported" in result.stderr


def test_upstream_model_keys_train(local_model, tmp_path):
    """upstream's most common model keys (torch_dtype: bf16, use_liger_kernel: false, force_hf: true,
    use_sdpa_patching with sdpa_method) build and train; they crashed in transformers before."""
    result = run_cli("finetune", "llm", "-c", CONFIGS / "squad_sft.yaml",
                     "--model.pretrained_model_name_or_path", local_model, "--model.torch_dtype", "bf16",
                     "--model.use_liger_kernel", "false", "--model.force_hf", "true",
                     "--model.use_sdpa_patching", "true", "--model.sdpa_method", "[flash_attention, math]",
                     "--dataset.dataset_name", SQUAD_DIR, "--validation_dataset.dataset_name", SQUAD_DIR,
                     "--step_scheduler.max_steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoint_dirs(tmp_path / "checkpoints") == ["epoch_0_step_2"]
    final = json.loads((tmp_path / "checkpoints" / "epoch_0_step_2" / "model" / "config.json").read_text())
    assert final["dtype"] == "bfloat16" and "use_liger_kernel" not in final and "force_hf" not in final


def test_upstream_muon_config_trains_with_muon_and_scheduled_groups(local_model, tmp_path):
    """upstream's dion.Muon with all its keys: matrices step with Muon (their momentum is in the checkpoint), the
    other groups with AdamW, and the schedule keeps each group's rate in proportion to lr."""
    result = run_cli("finetune", "llm", "-c", CONFIGS / "squad_muon.yaml",
                     "--model.pretrained_model_name_or_path", local_model,
                     "--dataset.dataset_name", SQUAD_DIR, "--validation_dataset.dataset_name", SQUAD_DIR,
                     "--step_scheduler.log_interval", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: optimizer.betas: [0.9, 0.95] governs nothing" in result.stderr
    records = read_jsonl(tmp_path / "checkpoints" / "training.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in records)
    manifest = json.loads((tmp_path / "checkpoints" / "epoch_0_step_3" / "optim" / "optimizer.json").read_text())
    groups = manifest["param_groups"]
    assert [g["algorithm"] for g in groups] == ["muon", "adamw", "adamw", "adamw"]
    assert [g["lr"] / groups[0]["lr"] for g in groups] == pytest.approx([1.0, 0.5, 0.25, 0.5])
    assert groups[0]["lr"] < 2.0e-3  # decayed by the cosine schedule
    assert [g["weight_decay"] for g in groups] == [0.01, 0.01, 0.0, 0.0]
    saved = {name for _, name in manifest["tensors"].values()}
    assert saved == {"momentum_buffer", "exp_avg", "exp_avg_sq"}


def test_upstream_muon_settings_that_cannot_act_are_refused(local_model, tmp_path):
    result = run_cli_inprocess("validate", "-c", CONFIGS / "squad_muon.yaml", "--model.pretrained_model_name_or_path",
                               local_model, "--optimizer.use_triton", "true", "--optimizer.scalar_opt", "lion",
                               "--optimizer.adjust_lr", "frobenius", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "optimizer.use_triton: true selects dion's Triton Newton-Schulz kernels (CUDA)" in result.stderr
    assert "optimizer.scalar_opt: lion" in result.stderr and "optimizer.adjust_lr" in result.stderr
    assert "Traceback" not in result.stderr
