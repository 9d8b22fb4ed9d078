"""Encoder-decoder (T5) fine-tuning: upstream's NeMoAutoModelForSeq2SeqLM and make_seq2seq_dataset, the unshifted
loss, a CLI run in upstream's T5 form, its checkpoint, and what such a run refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_testing import ASSETS, SQUAD_DIR, losses, validate_cli

from automodel.testing import run_cli, train_inprocess, write_yaml

T5_DIR = ASSETS / "tiny_t5"  # config.json only (a fresh model) and a T5 (unigram) tokenizer


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(T5_DIR)


def _rows(split: str = "train") -> list[dict]:
    import json

    return [json.loads(line) for line in (SQUAD_DIR / f"{split}.jsonl").read_text().splitlines()]


def upstream_t5_config(checkpoint_dir: Path, **sections) -> dict:
    """Upstream's t5_small_squad.yaml form (its recipe, keys and targets), on the tiny T5 and the local SQuAD."""
    dataset = {"_target_": "nemo_automodel.components.datasets.llm.seq2seq.make_seq2seq_dataset",
               "dataset_name": str(SQUAD_DIR), "split": "train", "limit_dataset_samples": 24}
    config = {
        "recipe": "TrainFinetuneRecipeForNextTokenPrediction",
        "step_scheduler": {"global_batch_size": 4, "local_batch_size": 4, "ckpt_every_steps": 3,
                           "val_every_steps": 3, "max_steps": 3},
        "dist_env": {"backend": "gloo", "timeout_minutes": 1},
        "rng": {"_target_": "nemo_automodel.components.training.rng.StatefulRNG", "seed": 1111, "ranked": True},
        "model": {"_target_": "nemo_automodel.NeMoAutoModelForSeq2SeqLM.from_pretrained",
                  "pretrained_model_name_or_path": str(T5_DIR)},
        "tokenizer": {"_target_": "nemo_automodel.NeMoAutoTokenizer.from_pretrained",
                      "pretrained_model_name_or_path": str(T5_DIR)},
        "checkpoint": {"enabled": True, "checkpoint_dir": str(checkpoint_dir), "model_save_format": "safetensors",
                       "save_consolidated": True},
        "distributed": {"strategy": "fsdp2", "dp_size": None, "tp_size": 1, "cp_size": 1, "sequence_parallel": False},
        "loss_fn": {"_target_": "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy"},
        "dataset": dataset,
        "packed_sequence": {"packed_sequence_size": 0},
        "dataloader": {"_target_": "torchdata.stateful_dataloader.StatefulDataLoader",
                       "collate_fn": "nemo_automodel.components.datasets.utils.default_collater", "shuffle": False},
        "validation_dataset": {**dataset, "split": "validation", "limit_dataset_samples": 8},
        "validation_dataloader": {"_target_": "torchdata.stateful_dataloader.StatefulDataLoader",
                                  "collate_fn": "nemo_automodel.components.datasets.utils.default_collater"},
        "optimizer": {"_target_": "torch.optim.Adam", "betas": [0.9, 0.999], "eps": 1e-8, "lr": 1.0e-3,
                      "weight_decay": 0},
        "lr_scheduler": {"lr_decay_style": "cosine", "min_lr": 1.0e-6},
    }
    for name, value in sections.items():
        if value is None:
            config.pop(name, None)
        else:
            config[name] = {**config.get(name, {}), **value} if isinstance(value, dict) else value
    return config


# ---- the data set ----------------------------------------------------------------------------------------------

def test_samples_are_source_target_and_right_shifted_decoder_inputs():
    from automodel_llm.datasets import Seq2SeqDataset

    tokenizer = _tokenizer()
    dataset = Seq2SeqDataset(tokenizer, dataset_name=str(SQUAD_DIR), limit_dataset_samples=4)
    row = _rows()[0]
    sample = dataset[0]
    source = tokenizer(f"question: {row['question']}  context: {row['context']}")["input_ids"]
    target = tokenizer(text_target=row["answers"]["text"][0])["input_ids"]
    assert sample["input_ids"] == source and sample["attention_mask"] == [1] * len(source)
    assert sample["labels"] == target and target[-1] == tokenizer.eos_token_id  # unshifted, ends with EOS
    assert sample["decoder_input_ids"] == [tokenizer.pad_token_id] + target[:-1]  # T5 starts from its pad id
    assert len(dataset) == 4


def test_batches_pad_the_source_and_the_target_each_to_its_longest():
    from automodel_llm.datasets import Seq2SeqDataset
    from automodel_llm.datasets.collate import default_collater

    samples = [{"input_ids": [5, 6, 7, 1], "attention_mask": [1] * 4, "labels": [8, 1], "decoder_input_ids": [0, 8]},
               {"input_ids": [5, 1], "attention_mask": [1, 1], "labels": [9, 10, 11, 1],
                "decoder_input_ids": [0, 9, 10, 11]}]
    batch = default_collater(samples, pad_token_id=3)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1], [5, 1, 3, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[8, 1, -100, -100], [9, 10, 11, 1]]
    assert batch["decoder_input_ids"].tolist() == [[0, 8, 3, 3], [0, 9, 10, 11]]
    dataset = Seq2SeqDataset(_tokenizer(), dataset_name=str(SQUAD_DIR), limit_dataset_samples=3)
    real = default_collater([dataset[i] for i in range(3)])
    assert real["labels"].shape == real["decoder_input_ids"].shape != real["input_ids"].shape


def test_arguments_act():
    from automodel.errors import AutomodelError
    from automodel_llm.datasets import Seq2SeqDataset

    tokenizer, row = _tokenizer(), _rows("validation")[0]
    cut = Seq2SeqDataset(tokenizer, seq_length=12, split="validation", dataset_name=str(SQUAD_DIR),
                         limit_dataset_samples=2)
    assert len(cut[0]["input_ids"]) == 12 and cut[0]["input_ids"][-1] == tokenizer.eos_token_id
    with pytest.raises(AutomodelError, match="dataset.seq_length: row 1 .* longer than 12 tokens"):
        Seq2SeqDataset(tokenizer, seq_length=12, truncation=False, dataset_name=str(SQUAD_DIR), split="validation")
    own = Seq2SeqDataset(tokenizer, split="validation", dataset_name=str(SQUAD_DIR), limit_dataset_samples=1,
                         source_template=None, source_key="context", target_key="question", decoder_start_token_id=7)
    assert own[0]["input_ids"] == tokenizer(row["context"])["input_ids"]
    assert own[0]["labels"] == tokenizer(text_target=row["question"])["input_ids"]
    assert own[0]["decoder_input_ids"][0] == 7
    with pytest.raises(AutomodelError, match="lacks the column.*nope"):
        Seq2SeqDataset(tokenizer, dataset_name=str(SQUAD_DIR), source_template="{nope}: {question}")


# ---- the loss --------------------------------------------------------------------------------------------------

_LOSS = "nemo_automodel.components.loss."


@pytest.mark.parametrize(("label_positions_only", "loss_fn"), [
    (True, "masked_ce.MaskedCrossEntropy"), (False, "masked_ce.MaskedCrossEntropy"),
    (True, "linear_ce.FusedLinearCrossEntropy"), (False, "chunked_ce.ChunkedCrossEntropy")])
def test_loss_per_label_token_equals_the_models_own(label_positions_only, loss_fn, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "t5.yaml", upstream_t5_config(tmp_path / "ckpt", logits={
        "label_positions_only": label_positions_only}, loss_fn={"_target_": _LOSS + loss_fn}))
    recipe = train_inprocess(config, setup_only=True)
    assert recipe.label_offset == 0
    batch = recipe.move_to_device(next(iter(recipe.dataloader)))
    model = recipe.model.eval()  # T5's dropout off: two forwards to compare
    loss = recipe.compute_loss(model, batch) / recipe.count_label_tokens(batch)
    labels = batch["labels"]
    assert (labels == -100).any()  # padding in the batch, left out of both
    expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
    torch.testing.assert_close(loss, expected)
    assert recipe.count_label_tokens(batch) == int((labels != -100).sum())


# ---- a run from the CLI, in upstream's form -------------------------------------------------------------------

@pytest.mark.parametrize("command", [("finetune", "llm"), ("run",)])
def test_upstream_t5_form_trains_from_the_cli_and_saves_a_transformers_seq2seq_model(command, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    config = write_yaml(tmp_path / "t5.yaml", upstream_t5_config(tmp_path / "ckpt"))
    result = run_cli(*command, "-c", config, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "AutoModelForSeq2SeqLM.from_pretrained" in result.stderr
    assert len(losses(tmp_path / "ckpt")) >= 1
    saved = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ckpt" / "epoch_0_step_3" / "model")
    assert saved.config.is_encoder_decoder and saved.config.model_type == "t5"


def test_checkpoint_holds_the_trained_weights(tmp_path, monkeypatch):
    from transformers import AutoModelForSeq2SeqLM

    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "t5.yaml", upstream_t5_config(tmp_path / "ckpt"))
    recipe = train_inprocess(config)
    saved = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ckpt" / "epoch_0_step_3" / "model").eval()
    trained = recipe.model.eval()
    batch = recipe.move_to_device(next(iter(recipe.dataloader)))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "decoder_input_ids")}
    with torch.no_grad():
        torch.testing.assert_close(saved(**inputs).logits, trained(**inputs).logits)
        fresh = AutoModelForSeq2SeqLM.from_config(saved.config)
        assert not torch.allclose(fresh(**inputs).logits, saved(**inputs).logits)


@pytest.mark.slow
def test_fsdp2_over_two_ranks_trains_as_one_process(tmp_path):
    """Global batch 8: two ranks of 4 against one process accumulating two micro-batches of 4 (no dropout in the
    tiny T5, so both runs compute the same steps)."""
    from safetensors.torch import load_file

    from automodel.testing import free_port

    config = write_yaml(tmp_path / "t5.yaml", upstream_t5_config(tmp_path / "ckpt", step_scheduler={
        "global_batch_size": 8}))
    runs = {"one": [], "two": ["--nproc-per-node", "2", "--master-port", str(free_port())]}
    for name, args in runs.items():
        result = run_cli("run", "-c", config, *args, "--checkpoint.checkpoint_dir", tmp_path / name, cwd=tmp_path,
                         OMP_NUM_THREADS="1")
        assert result.returncode == 0, result.stderr[-3000:]
    assert "FSDP2 over 2 ranks" in result.stderr
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    one, two = (load_file(tmp_path / name / "epoch_0_step_3" / "model" / "model.safetensors") for name in runs)
    assert one.keys() == two.keys()
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, atol=1e-4, rtol=0)  # Adam steps of lr 1e-3


def test_from_pretrained_reads_every_weight_of_a_saved_t5(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(3)
    saved = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(T5_DIR))
    saved.save_pretrained(tmp_path / "t5")
    config = upstream_t5_config(tmp_path / "ckpt", model={"pretrained_model_name_or_path": str(tmp_path / "t5")})
    built = train_inprocess(write_yaml(tmp_path / "t5.yaml", config), setup_only=True).model.state_dict()
    assert built.keys() == saved.state_dict().keys()
    for key, value in saved.state_dict().items():
        torch.testing.assert_close(built[key], value)


# ---- refusals --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("sections", "key", "reason"), [
    ({"packed_sequence": {"packed_sequence_size": 64}}, "packed_sequence.packed_sequence_size", "packing joins"),
    ({"distributed": {"tp_size": 2}}, "distributed.tp_size", "tensor parallelism"),
    ({"distributed": {"pp_size": 2}}, "distributed.pp_size", "pipeline stages"),
    ({"distributed": {"cp_size": 2}}, "distributed.cp_size", "context parallelism"),
    ({"eval_generation": {"enabled": True}}, "eval_generation.enabled", "exact-match generation"),
    ({"dataset": {"_target_": "nemo_automodel.components.datasets.llm.squad.make_squad_dataset"}},
     "dataset._target_", "one causal token stream"),
    ({"model": {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
                "config": str(ASSETS / "tiny_llama" / "config.json"), "pretrained_model_name_or_path": None},
      "tokenizer": {"pretrained_model_name_or_path": str(ASSETS / "tiny_tokenizer")}},
     "dataset._target_", "for an encoder-decoder model"),
    ({"model": {"num_nextn_predict_layers": 1}}, "model", "num_nextn_predict_layers"),
])
def test_what_an_encoder_decoder_run_cannot_use_is_refused(sections, key, reason, tmp_path):
    config = upstream_t5_config(tmp_path / "ckpt", **sections)
    config["model"] = {k: v for k, v in config["model"].items() if v is not None}
    code, output = validate_cli(write_yaml(tmp_path / "t5.yaml", config), tmp_path, "--nproc-per-node", "2")
    assert code == 2, output
    assert key in output and reason in output, output


def test_distillation_refuses_an_encoder_decoder(tmp_path):
    config = upstream_t5_config(tmp_path / "ckpt", recipe="KnowledgeDistillationRecipeForNextTokenPrediction",
                                teacher_model={"_target_": "nemo_automodel.NeMoAutoModelForSeq2SeqLM.from_pretrained",
                                               "pretrained_model_name_or_path": str(T5_DIR)})
    code, output = validate_cli(write_yaml(tmp_path / "kd.yaml", config), tmp_path)
    assert code == 2 and "model._target_" in output and "knowledge distillation" in output, output


def test_a_decoder_start_the_model_does_not_use_is_refused(tmp_path, monkeypatch):
    from automodel.errors import AutomodelError

    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "t5.yaml", upstream_t5_config(tmp_path / "ckpt", dataset={
        "decoder_start_token_id": 1}))
    with pytest.raises(AutomodelError, match="decoder_start_token_id: the decoder inputs start from 1, but the "
                                             "model's decoder_start_token_id is 0"):
        train_inprocess(config, setup_only=True)
