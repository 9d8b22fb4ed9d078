"""A model read from a GGUF file (``model.gguf_file``, llama.cpp's format; transformers unpacks it into float
weights): its tokenizer comes from the same file, and the checkpoint the run saves is a plain transformers model,
with no GGUF ``quantization_config`` left in its config. The real SmolLM2 GGUF file: test_real_smollm2.py."""

from __future__ import annotations

import json

import torch
from llm_testing import SQUAD_DIR, TOKENIZER_DIR, write_tiny_gguf

from automodel.testing import checkpoint_dirs, train_inprocess, write_yaml


def test_a_gguf_model_trains_with_the_files_tokenizer_and_saves_a_plain_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (tmp_path / "gguf").mkdir()
    gguf_file = write_tiny_gguf(tmp_path / "gguf")
    config = write_yaml(tmp_path / "cfg.yaml", {
        "step_scheduler": {"max_steps": 2, "log_interval": 1},
        "model": {"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
                  "pretrained_model_name_or_path": str(tmp_path / "gguf"), "gguf_file": gguf_file},
        "dataset": {"_target_": "automodel_llm.datasets.SquadDataset", "dataset_name": str(SQUAD_DIR),
                    "split": "train", "max_seq_length": 64, "limit_dataset_samples": 8},
        "dataloader": {"batch_size": 4},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1.0e-3},
        "checkpoint": {"checkpoint_dir": str(tmp_path / "ckpt")},
        "eval_generation": {"enabled": False},
    })
    recipe = train_inprocess(config)  # no tokenizer: section: the model's directory holds only the GGUF file
    shipped = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    text = "Context: the sky is blue. Question: what colour is the sky? Answer: blue"
    assert recipe.tokenizer(text)["input_ids"] == shipped(text)["input_ids"]
    assert getattr(recipe.model.config, "quantization_config", None) is None
    assert not getattr(recipe.model, "is_quantized", False)

    model_dir = tmp_path / "ckpt" / checkpoint_dirs(tmp_path / "ckpt")[-1] / "model"
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not getattr(loaded, "is_quantized", False)
    loaded.save_pretrained(tmp_path / "again")  # refused for a model that claims GGUF quantization
    inputs = torch.tensor([shipped(text)["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=inputs).logits, recipe.model.eval()(input_ids=inputs).logits,
                              atol=1e-5)
