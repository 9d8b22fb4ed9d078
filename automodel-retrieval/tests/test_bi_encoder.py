"""Bi-encoder: it learns (held-out recall@1 rises above the untrained model's), and its checkpoints are HF models."""

from __future__ import annotations

import json

import pytest
import torch
from retrieval_testing import BI_ENCODER, DATA, PKG_DIR, latest, run_inprocess, write_config

from automodel.errors import ConfigError
from automodel.testing import load_config, read_jsonl


def test_training_raises_held_out_recall_above_the_untrained_model(bi_encoder_run):
    before, after = bi_encoder_run["validation"][0], bi_encoder_run["validation"][-1]
    assert (before["step"], after["step"]) == (0, 40)
    for record in (before, after):
        assert {"val_loss", "recall@1", "recall@5", "recall@10", "mrr"} <= record.keys()
        assert record["corpus_size"] == 240  # every query is ranked against the whole corpus
    print(f"bi-encoder recall@1 {before['recall@1']:.3f} -> {after['recall@1']:.3f}, "
          f"mrr {before['mrr']:.3f} -> {after['mrr']:.3f}")
    assert after["recall@1"] >= before["recall@1"] + 0.25, (before, after)
    assert after["mrr"] > before["mrr"]
    assert after["val_loss"] < before["val_loss"]
    losses = [r["loss"] for r in read_jsonl(bi_encoder_run["ckpt"] / "training.jsonl")]
    assert sum(losses[-5:]) < sum(losses[:5])


@pytest.mark.smoke
def test_checkpoint_encoders_load_with_transformers_automodel(bi_encoder_run):
    from transformers import AutoModel, AutoTokenizer

    from automodel_retrieval.models import pool

    model_dir = latest(bi_encoder_run["ckpt"]) / "model"
    settings = json.loads((model_dir / "bi_encoder_config.json").read_text())
    assert settings["shared"] is False and settings["pooling"] == "mean"
    recipe = bi_encoder_run["recipe"]
    model = recipe.model.eval()
    texts = ["capital of Sikia", "Sikia's capital city is Zoranton, home to its royal court."]
    loaded = {}
    for side, name in (("query", "query_encoder"), ("document", "document_encoder")):
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir / name))
        encoder = AutoModel.from_pretrained(str(model_dir / name)).eval()
        loaded[side] = encoder
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            ours = model.encode(side, dict(batch))
            theirs = torch.nn.functional.normalize(pool(encoder(**batch).last_hidden_state,
                                                        batch["attention_mask"], "mean"), dim=-1)
        assert torch.allclose(ours, theirs, atol=1e-6)
    # separate weights really are separate (they started equal, training moved them apart)
    q = loaded["query"].embeddings.word_embeddings.weight
    d = loaded["document"].embeddings.word_embeddings.weight
    assert not torch.equal(q, d)


def test_bi_encoder_from_pretrained_reads_a_run_directory(bi_encoder_run):
    from automodel_retrieval import BiEncoder

    reloaded = BiEncoder.from_pretrained(str(bi_encoder_run["ckpt"]))  # LATEST -> model/
    trained = bi_encoder_run["recipe"].model
    assert not reloaded.shared and reloaded.pooling == "mean"
    for a, b in zip(reloaded.state_dict().values(), trained.state_dict().values(), strict=True):
        assert torch.equal(a, b.cpu())


def test_shared_encoder_is_saved_as_one_hf_model(tmp_path):
    from transformers import AutoModel

    config = write_config(tmp_path / "cfg.yaml", BI_ENCODER, tmp_path / "ckpt", validation_dataset=None,
                          step_scheduler={"max_steps": 2}, model={"shared": True, "pooling": "cls"})
    recipe = run_inprocess("bi", config)
    model = recipe.model
    assert model.shared and model.encoder("query") is model.encoder("document")
    model_dir = latest(tmp_path / "ckpt") / "model"
    assert (model_dir / "config.json").is_file() and not (model_dir / "query_encoder").exists()
    assert json.loads((model_dir / "bi_encoder_config.json").read_text())["shared"] is True
    encoder = AutoModel.from_pretrained(str(model_dir))
    assert sum(p.numel() for p in encoder.parameters()) == sum(p.numel() for p in model.parameters())
    for key, value in encoder.state_dict().items():
        assert torch.equal(value, model.query_encoder.state_dict()[key]), key


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_config_errors_are_reported_together(tmp_path, temperature):
    from retrieval_testing import load_config

    from automodel.errors import ConfigError

    config = write_config(tmp_path / "cfg.yaml", BI_ENCODER, tmp_path / "ckpt", model={"pooling": "max"},
                          loss_fn={"temperature": temperature}, retrieval={"recall_at": [0]},
                          dataset={"path": str(DATA / "train.jsonl"), "num_negativs": 3})
    with pytest.raises(ConfigError) as err:
        load_config("bi", config)
    keys = {issue.key for issue in err.value.issues}
    assert {"model.pooling", "loss_fn.temperature", "retrieval.recall_at", "dataset.num_negativs"} <= keys, keys


def test_fine_tuning_continues_from_a_trained_checkpoint_with_its_own_tokenizer(bi_encoder_run, tmp_path):
    """model: BiEncoder.from_pretrained(<a run>) and no tokenizer section: the tokenizer saved beside the
    encoders is used, and training starts from the trained weights (its first loss is already low)."""
    config = write_config(tmp_path / "cfg.yaml", BI_ENCODER, tmp_path / "ckpt", tokenizer=None,
                          validation_dataset=None, step_scheduler={"max_steps": 1},
                          model={"_target_": "automodel_retrieval.BiEncoder.from_pretrained", "config": None,
                                 "pretrained_model_name_or_path": str(bi_encoder_run["ckpt"])})
    run_inprocess("bi", config)
    fresh = read_jsonl(bi_encoder_run["ckpt"] / "training.jsonl")[0]["loss"]
    continued = read_jsonl(tmp_path / "ckpt" / "training.jsonl")[0]["loss"]
    assert continued < fresh / 2, (continued, fresh)


def test_lora_is_refused_with_the_reason_for_a_bi_encoder_and_its_distillation():
    """peft's adapter has no place in a sentence-transformers model/ (before: a traceback from peft at setup)."""
    for route, example in ((("finetune", "retrieval"), "tiny_bi_encoder"), (("kd", "retrieval"), "tiny_distill")):
        with pytest.raises(ConfigError, match="peft: LoRA on a bi-encoder is not built here"):
            load_config(PKG_DIR / "examples" / f"{example}.yaml", "--peft.dim", "4", route=route)
