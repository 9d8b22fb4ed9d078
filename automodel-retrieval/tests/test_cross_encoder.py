"""Cross-encoder: accuracy on held-out questions rises above chance; the checkpoint is an HF sequence classifier."""

from __future__ import annotations

import torch
from retrieval_testing import latest

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
