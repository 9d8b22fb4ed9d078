"""The seed configuration (/work/shared/seed-config.yaml, the upstream recipe guide's full config) trains unchanged
except for where its model and data live and how long it runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from llm_testing import SQUAD_DIR, TOKENIZER_DIR

from automodel.testing import checkpoint_dirs, read_jsonl, run_cli

SEED_CONFIG = Path("/work/shared/seed-config.yaml")
if not SEED_CONFIG.is_file():  # the repository's copy, when the shared one is not mounted
    SEED_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "seed-config.yaml"

# Mamba (M), attention (*) and MLP (-) layers, each tiny; the PyTorch fallbacks of the Mamba kernels run on a CPU.
NEMOTRON_H = dict(hidden_size=32, layers_block_type=["linear_attention", "full_attention", "mlp"],
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                  ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, chunk_size=16,
                  max_position_embeddings=512, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def nemotron_h_dir(tmp_path_factory) -> Path:
    """A randomly initialised tiny NemotronH saved with the shipped tokenizer, as a hub checkpoint would be."""
    from transformers import AutoTokenizer, NemotronHConfig, NemotronHForCausalLM

    directory = tmp_path_factory.mktemp("tiny_nemotron_h")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = NemotronHConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **NEMOTRON_H)
    torch.manual_seed(0)
    NemotronHForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_tiny_nemotron_h_trains_on_cpu(nemotron_h_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(nemotron_h_dir)
    assert model.config.hybrid_override_pattern == "M*-"
    ids = torch.randint(3, model.config.vocab_size, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, 16:] = 0
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.skipif(not SEED_CONFIG.is_file(), reason="seed-config.yaml is not available here")
def test_seed_config_validates_and_trains(nemotron_h_dir, tmp_path):
    config = tmp_path / "seed-config.yaml"
    shutil.copy(SEED_CONFIG, config)
    ckpt = tmp_path / "checkpoints"
    result = run_cli(
        "finetune", "llm", "-c", "seed-config.yaml",
        "--model.name_or_path", nemotron_h_dir,
        "--dataset.tokenizer_name_or_path", nemotron_h_dir,
        "--dataset.dataset_name", SQUAD_DIR,
        "--validation_dataset.dataset_name", SQUAD_DIR,
        "--step_scheduler.max_steps", "4",
        "--step_scheduler.val_check_interval", "2",
        "--step_scheduler.checkpoint_interval", "4",
        "--checkpoint.checkpoint_dir", ckpt,
        cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]

    assert checkpoint_dirs(ckpt) == ["epoch_0_step_4"]
    assert (ckpt / "LATEST").read_text().strip() == "epoch_0_step_4"
    assert [r["step"] for r in read_jsonl(ckpt / "validation.jsonl")] == [2, 4]
    rows = read_jsonl(ckpt / "training.jsonl")
    assert [r["step"] for r in rows] == [4]  # log_interval 10: only the last step is logged
    assert torch.isfinite(torch.tensor(rows[0]["loss"]))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = ckpt / "epoch_0_step_4" / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "NemotronHForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    inputs = tokenizer("Context: Pella lives in Tolven. Question: Where does Pella live? Answer:",
                       return_tensors="pt")
    assert model.generate(**inputs, max_new_tokens=2, do_sample=False).shape[1] > inputs["input_ids"].shape[1]
    saved = yaml.safe_load((ckpt / "epoch_0_step_4" / "config.yaml").read_text())
    assert saved["model"]["_target_"] == "nemo_automodel.models.llm.NemotronHForCausalLM"
    assert saved["step_scheduler"]["grad_accumulation_steps"] == 4
    state = json.loads((ckpt / "epoch_0_step_4" / "trainer_state.json").read_text())
    assert state["step"] == 4
