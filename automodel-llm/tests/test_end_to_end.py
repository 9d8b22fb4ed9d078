"""End to end through the installed ``automodel`` console script: step semantics, metric files, checkpoint layout
(DESIGN §9, §10), and the trained model loading back with plain transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from llm_testing import METRIC_FIELDS, TINY_LLAMA_OVERRIDES, VALIDATION

from automodel.testing import assert_states_equal, checkpoint_dirs, read_jsonl, run_cli, train_inprocess


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, tiny_llama_config):
    """max_steps=10, checkpoint_interval=4, val_check_interval=5, log_interval=1 (overrides on the command line)."""
    from llm_testing import write_config

    root = tmp_path_factory.mktemp("e2e")
    config = write_config(root / "cfg.yaml", tiny_llama_config, root / "ckpt", validation_dataset=VALIDATION)
    result = run_cli("finetune", "llm", "-c", config, "--step_scheduler.max_steps", "10",
                     "--step_scheduler.checkpoint_interval=4", "--step_scheduler.val_check_interval", "5",
                     "--step_scheduler.log_interval", "1", cwd=root)
    assert result.returncode == 0, result.stderr[-4000:]
    return root / "ckpt"


def test_checkpoint_dirs_and_latest(cli_run):
    # 32 samples / batch 4 = 8 steps per epoch: steps 4 and 8 fall in epoch 0, step 10 in epoch 1.
    assert checkpoint_dirs(cli_run) == ["epoch_0_step_4", "epoch_0_step_8", "epoch_1_step_10"]
    assert (cli_run / "LATEST").read_text().strip() == "epoch_1_step_10"
    assert [p.name for p in cli_run.iterdir() if p.name.startswith(".")] == [".lock"], "staging left behind"


def test_training_jsonl_has_every_step_and_field(cli_run):
    rows = read_jsonl(cli_run / "training.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    for row in rows:
        assert set(METRIC_FIELDS) <= row.keys(), set(METRIC_FIELDS) - row.keys()
        assert math.isfinite(row["loss"]) and row["loss"] > 0
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] >= 0
        assert row["lr"] > 0 and row["mem"] > 0 and row["tps"] > 0
        assert row["mfu"] is None or row["mfu"] >= 0  # no known peak FLOP/s on a CPU
    assert [r["epoch"] for r in rows] == [0] * 8 + [1] * 2
    timestamps = [r["timestamp"] for r in rows]
    assert timestamps == sorted(timestamps)
    assert rows[-1]["loss"] < rows[0]["loss"], "ten steps at lr 3e-3 should reduce the loss"


def test_validation_at_steps_5_and_10(cli_run):
    rows = read_jsonl(cli_run / "validation.jsonl")
    assert [r["step"] for r in rows] == [5, 10]
    for row in rows:
        assert row["name"] == "validation" and math.isfinite(row["val_loss"]) and row["num_label_tokens"] > 0


@pytest.mark.parametrize("name", ["epoch_0_step_4", "epoch_0_step_8", "epoch_1_step_10"])
def test_checkpoint_contents(cli_run, name):
    ckpt = cli_run / name
    model = ckpt / "model"
    assert (model / "config.json").is_file()
    assert list(model.glob("*.safetensors"))
    assert not list(model.glob("*.bin")) and not list(model.glob("*.pt")), "weights must not be pickled"
    assert (model / "tokenizer_config.json").is_file() and (model / "tokenizer.json").is_file()
    for sub in ("optim", "rng", "dataloader"):
        assert (ckpt / sub).is_dir() and any((ckpt / sub).iterdir()), sub
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == int(name.rsplit("_", 1)[1])
    assert state["epoch"] == int(name.split("_")[1])
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert config["step_scheduler"]["max_steps"] == 10 and config["step_scheduler"]["checkpoint_interval"] == 4


def test_trained_model_loads_with_transformers_and_matches_final_weights(tmp_path, make_config):
    """Acceptance 1: the checkpoint's model/ is a plain HF model + tokenizer equal to the final in-memory weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = make_config(step_scheduler={"max_steps": 6, "checkpoint_interval": 4})
    recipe = train_inprocess(config)
    final = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
    root = tmp_path / "ckpt"
    latest = root / (root / "LATEST").read_text().strip()
    assert latest.name == "epoch_0_step_6"

    model = AutoModelForCausalLM.from_pretrained(latest / "model")
    tokenizer = AutoTokenizer.from_pretrained(latest / "model")
    assert model.config.hidden_size == TINY_LLAMA_OVERRIDES["hidden_size"]
    assert_states_equal(model.state_dict(), final)
    # and the weights really moved away from the step-4 checkpoint
    older = AutoModelForCausalLM.from_pretrained(root / "epoch_0_step_4" / "model").state_dict()
    assert any(not torch.equal(older[k], final[k]) for k in final)

    text = "Context: Pella lives in Tolven. Question: Where does Pella live? Answer:"
    assert tokenizer(text)["input_ids"] == recipe.tokenizer(text)["input_ids"]
    inputs = tokenizer(text, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[0] == 1 and inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 4
    assert isinstance(tokenizer.decode(out[0]), str)
    with torch.no_grad():
        recipe.model.eval()
        assert torch.equal(model(**inputs).logits, recipe.model(**inputs).logits)


@pytest.mark.smoke
def test_shipped_example_runs_through_cli_and_loads(tmp_path):
    """``-c llm/tiny_squad`` (the shipped example) with model-size and run-length overrides, then transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    overrides = [f"--model.{k}={v}" for k, v in TINY_LLAMA_OVERRIDES.items()]
    result = run_cli("finetune", "llm", "-c", "llm/tiny_squad", *overrides, "--step_scheduler.max_steps", "3",
                     "--step_scheduler.val_check_interval", "3", "--dataset.limit_dataset_samples", "24",
                     "--validation_dataset.limit_dataset_samples", "4", "--dataloader.batch_size", "8",
                     "--eval_generation.num_examples", "2", "--checkpoint.checkpoint_dir", tmp_path / "run",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    root = tmp_path / "run"
    model_dir = root / (root / "LATEST").read_text().strip() / "model"
    assert model_dir.parent.name == "epoch_0_step_3"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.num_hidden_layers == 1
    inputs = tokenizer("Context: Mara keeps a white frog. Question: Who keeps a frog? Answer:", return_tensors="pt")
    assert model.generate(**inputs, max_new_tokens=3, do_sample=False).shape[1] > inputs["input_ids"].shape[1]
    assert [r["step"] for r in read_jsonl(root / "validation.jsonl")] == [3]
    assert json.loads((root / "eval_generation.json").read_text())["num_questions"] == 2
    saved = (model_dir.parent / "config.yaml").read_text()
    assert "${pkg:automodel_llm}/examples/assets/tiny_squad" in saved, "config.yaml must keep ${...} placeholders"
    assert yaml.safe_load(saved)["model"]["hidden_size"] == TINY_LLAMA_OVERRIDES["hidden_size"]  # overrides applied
