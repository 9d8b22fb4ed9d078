"""``distributed.activation_checkpointing: true`` through the real recipe in one process: every transformer block
recomputes its activations in backward, so the losses stay those of the run without it while the peak memory of a
long-sequence run drops (training.jsonl's ``mem``: the process's peak resident memory). The same with FSDP2 is in
test_fsdp.py (HSDP), with DDP in test_distributed.py."""

from __future__ import annotations

import json

import pytest
from llm_testing import losses

from automodel.testing import read_jsonl, run_cli

# A 4-block Llama on 1024-token rows: eager attention keeps a [4, 4, 1024, 1024] probability tensor per block for
# backward (64 MB each), which checkpointing recomputes instead of keeping.
LONG_ROWS = ["--dataset._target_", "automodel_llm.datasets.MockDataset", "--dataset.num_samples", "8",
             "--dataset.seq_length", "1024", "--dataloader.batch_size", "4", "--step_scheduler.max_steps", "2",
             "--model.attn_implementation", "eager", "--checkpoint.enabled", "false"]


def test_checkpointing_keeps_the_losses_and_lowers_the_peak_memory(tmp_path, tiny_llama_config, make_config):
    model_config = json.loads(tiny_llama_config.read_text())
    model_config.update(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=4, head_dim=16, max_position_embeddings=1024)
    (tmp_path / "model.json").write_text(json.dumps(model_config))
    config = make_config(model={"config": str(tmp_path / "model.json")},
                         dataset={"dataset_name": None, "split": None, "max_seq_length": None,
                                  "limit_dataset_samples": None})
    runs = {}
    for name, flag in (("plain", "false"), ("checkpointed", "true")):
        result = run_cli("finetune", "llm", "-c", config, *LONG_ROWS, "--distributed.activation_checkpointing", flag,
                         "--checkpoint.checkpoint_dir", tmp_path / name, cwd=tmp_path, OMP_NUM_THREADS="1")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = result.stderr
    assert "activation checkpointing on 4 transformer blocks" in runs["checkpointed"]
    assert "activation checkpointing" not in runs["plain"]
    assert losses(tmp_path / "checkpointed") == pytest.approx(losses(tmp_path / "plain"), rel=1e-6, abs=1e-6)
    peak = {name: max(row["mem"] for row in read_jsonl(tmp_path / name / "training.jsonl")) for name in runs}
    # the plain run keeps 4 blocks' attention probabilities (256 MB); checkpointing keeps about one block's
    assert peak["checkpointed"] < peak["plain"] - 0.1, peak  # GiB

