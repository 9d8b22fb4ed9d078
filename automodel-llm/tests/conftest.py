"""Fixtures for the LLM domain's tests; its helpers are in llm_testing.py (on pytest.ini's pythonpath)."""

from __future__ import annotations

from pathlib import Path

import llm_testing
import pytest


@pytest.fixture(scope="session")
def tiny_llama_config(tmp_path_factory) -> Path:
    """config.json of a 1-layer, 32-wide Llama with the shipped tokenizer's vocabulary."""
    return llm_testing.write_tiny_llama_config(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def make_config(tmp_path, tiny_llama_config):
    """``make_config(name="cfg.yaml", **sections)``: a tiny run's YAML in tmp_path, checkpoints in tmp_path/ckpt."""

    def make(name: str = "cfg.yaml", **sections) -> Path:
        return llm_testing.write_config(tmp_path / name, tiny_llama_config, tmp_path / "ckpt", **sections)

    return make


@pytest.fixture(scope="session")
def single_process(tmp_path_factory, tiny_llama_config) -> tuple[Path, Path]:
    """(config, run directory) of the one-process reference for two ranks: accumulation doubled; validation (8
    samples) after steps 2 and 4; run once for all workers."""
    from automodel.testing import once_per_session, run_cli

    def run(tmp: Path) -> dict[str, Path]:
        config = llm_testing.write_config(tmp / "cfg.yaml", tiny_llama_config, tmp / "ckpt",
                                          validation_dataset=llm_testing.VALIDATION,
                                          step_scheduler={"val_check_interval": 2})
        result = run_cli("finetune", "llm", "-c", config, *llm_testing.DISTRIBUTED_OVERRIDES,
                         "--step_scheduler.grad_accumulation_steps", "2", cwd=tmp)
        assert result.returncode == 0, result.stderr[-2000:]
        return {"config": config, "dir": tmp}

    found = once_per_session(tmp_path_factory, "llm_single_process", run)
    return found["config"], found["dir"]


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory) -> Path:
    """The model/ directory of a 5-layer Llama trained 100 steps on the shipped chat rows: a target with something
    to say, for the speculative-decoding draft recipes; trained once for all workers."""
    import json

    from automodel.testing import once_per_session, run_cli, write_yaml

    def train(root: Path) -> dict[str, Path]:
        config = json.loads((llm_testing.ASSETS / "tiny_llama" / "config.json").read_text())
        config["num_hidden_layers"] = 5
        (root / "config.json").write_text(json.dumps(config))
        chat = llm_testing.ASSETS / "tiny_chat" / "train.jsonl"
        cfg = write_yaml(root / "target.yaml", {
            "step_scheduler": {"max_steps": 100, "log_interval": 50, "checkpoint_interval": 100, "num_epochs": 100},
            "rng": {"seed": 1},
            "model": {"_target_": "automodel_llm.AutoModelForCausalLM.from_config",
                      "config": str(root / "config.json")},
            "tokenizer": {"pretrained_model_name_or_path": str(llm_testing.TOKENIZER_DIR)},
            "dataset": {"_target_": "automodel_llm.datasets.ChatDataset", "path_or_dataset_id": str(chat),
                        "seq_length": 64},
            "dataloader": {"batch_size": 16}, "optimizer": {"_target_": "torch.optim.AdamW", "lr": 3e-3},
            "checkpoint": {"checkpoint_dir": str(root / "run")}})
        result = run_cli("finetune", "llm", "-c", cfg, cwd=root)
        assert result.returncode == 0, result.stderr[-3000:]
        return {"model": next((root / "run").glob("epoch_*_step_100")) / "model"}

    return once_per_session(tmp_path_factory, "llm_chat_target", train)["model"]
