"""Cross-encoder: accuracy on held-out questions rises above chance; the checkpoint is an HF sequence classifier."""

from __future__ import annotations

import json

import pytest
import torch
from retrieval_testing import CROSS_ENCODER, DATA, latest, run_inprocess, write_config

from automodel.errors import AutomodelError
from automodel.testing import read_jsonl


def test_training_lifts_accuracy_above_chance(cross_encoder_run):
    before, after = cross_encoder_run["validation"][0], cross_encoder_run["validation"][-1]
    assert before["step"] == 0 and after["step"] > 0
    assert after["chance_accuracy"] == 0.25  # one positive and three hard negatives per question
    print(f"cross-encoder accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, "
          f"mrr {before['mrr']:.3f} -> {after['mrr']:.3f}")
    # chance is 0.25 (96 questions: one standard error is about 0.044)
    assert after["accuracy"] >= 0.35, after
    assert after["accuracy"] >= before["accuracy"] + 0.1 and after["mrr"] > before["mrr"]
    assert after["val_loss"] < before["val_loss"]
    losses = [r["loss"] for r in read_jsonl(cross_encoder_run["ckpt"] / "training.jsonl")]
    assert sum(losses[-10:]) < sum(losses[:10])


def test_checkpoint_loads_with_auto_model_for_sequence_classification(cross_encoder_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = latest(cross_encoder_run["ckpt"]) / "model"
    loaded = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert loaded.config.num_labels == 1
    batch = tokenizer(["capital of Sikia", "capital of Sikia"],
                      ["Sikia's capital city is Zoranton, home to its royal court.",
                       "Sikia is governed by Duke Drar, who was crowned last spring."],
                      padding=True, return_tensors="pt")
    trained = cross_encoder_run["recipe"].model.eval()
    with torch.no_grad():
        assert loaded(**batch).logits.shape == (2, 1)
        assert torch.allclose(loaded(**batch).logits, trained(**batch).logits, atol=1e-6)


@pytest.mark.parametrize("section", ["validation_dataset", "dataset"])
def test_a_data_set_without_negatives_is_refused_with_the_file_and_what_to_add(section, tmp_path):
    """Groups of one document: accuracy = MRR = 1.0 from an untrained head (validation), a loss of 0 (training)."""
    rows = [json.loads(line) for line in (DATA / "validation.jsonl").read_text().splitlines()]
    bare = tmp_path / "no_negatives.jsonl"
    bare.write_text("".join(json.dumps({"query": r["query"], "positive": r["positive"]}) + "\n" for r in rows))
    config = write_config(tmp_path / "cfg.yaml", CROSS_ENCODER, tmp_path / "ckpt", step_scheduler={"max_steps": 1},
                          **{section: {"path": str(bare), "num_negatives": None}})
    with pytest.raises(AutomodelError) as err:
        run_inprocess("cross", config)
    message = str(err.value)
    assert message.startswith(f"{section}: no row of '{bare}' has negatives") and "add a 'negatives' list" in message
    assert not (tmp_path / "ckpt" / "LATEST").exists()
    config = write_config(tmp_path / "zero.yaml", CROSS_ENCODER, tmp_path / "ckpt",
                          **{section: {"num_negatives": 0}})
    with pytest.raises(AutomodelError, match=f"{section}.num_negatives: 0 leaves every query"):
        run_inprocess("cross", config)


def test_a_lora_checkpoint_exports_merged_with_the_runs_scores(tmp_path):
    """``automodel export`` merges a cross-encoder's LoRA adapter (its head trained whole, saved with it) with the
    recipe the checkpoint's config.yaml names; the merged classifier scores as the trained model does."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from automodel.testing import run_cli_inprocess

    config = write_config(tmp_path / "cfg.yaml", CROSS_ENCODER, tmp_path / "ckpt", step_scheduler={"max_steps": 3},
                          peft={"dim": 4, "alpha": 8})
    recipe = run_inprocess("cross", config)
    assert (latest(tmp_path / "ckpt") / "config.yaml").read_text().startswith(
        "recipe: automodel_retrieval.recipe.CrossEncoderRecipe\n")
    result = run_cli_inprocess("export", tmp_path / "ckpt", tmp_path / "merged", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    batch = tokenizer(["capital of Sikia"] * 2, ["Sikia's capital city is Zoranton.", "Sikia is governed by Drar."],
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(merged(**batch).logits, recipe.model.eval()(**batch).logits, atol=1e-5)


def test_two_ranks_report_the_accuracy_and_mrr_of_every_validation_group(tmp_path):
    """Each data-parallel rank scores its share of the validation groups, and accuracy and MRR are summed over the
    ranks: two ranks report one process's (which trains on the same rows with twice the accumulation). Before, rank 0
    reported its own half's."""
    from automodel.testing import free_port, run_cli

    common = ["finetune", "cross-encoder", "-c", "retrieval/tiny_cross_encoder", "--step_scheduler.max_steps", "2",
              "--step_scheduler.val_check_interval", "2", "--step_scheduler.checkpoint_interval", "1000"]
    one = run_cli(*common, "--step_scheduler.grad_accumulation_steps", "2", "--checkpoint.checkpoint_dir",
                  tmp_path / "one", cwd=tmp_path, OMP_NUM_THREADS="1")
    two = run_cli(*common, "--nproc-per-node", "2", "--master-port", free_port(), "--checkpoint.checkpoint_dir",
                  tmp_path / "two", cwd=tmp_path, OMP_NUM_THREADS="1")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    (expected,), (got,) = (read_jsonl(tmp_path / name / "validation.jsonl") for name in ("one", "two"))
    assert got["num_label_tokens"] == expected["num_label_tokens"] == 96
    for key in ("val_loss", "accuracy", "mrr", "chance_accuracy"):
        assert got[key] == pytest.approx(expected[key], rel=1e-6), key
