"""Sequence classification (`automodel finetune seq-cls`, upstream's TrainFinetuneRecipeForSequenceClassification):
the metrics against hand counts, the data sets, the shipped example's model and a LoRA adapter loaded with
transformers / peft and scored against the run's own validation records, upstream's config forms, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from llm_testing import ASSETS, TOKENIZER_DIR

from automodel.errors import AutomodelError
from automodel.testing import read_jsonl, run_cli, train_inprocess
from automodel_llm.datasets.collate import pad_collate
from automodel_llm.datasets.seq_cls import MockSequenceClassificationDataset, SequenceClassificationDataset
from automodel_llm.seq_cls import class_counts, classification_metrics

ROUTE = ("finetune", "seq-cls")
CLAIMS = ASSETS / "tiny_claims"
BERT = {"model_type": "bert", "vocab_size": 482, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0, "pad_token_id": 0}


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _config(tmp_path, name="cfg.yaml", **sections):
    """A tiny seq-cls run on the shipped claims: a 2-layer BERT from the mapping above, 4 steps of 8 rows."""
    claims = {"path_or_dataset_id": str(CLAIMS / "train.jsonl"), "text_fields": ["context", "claim"], "max_length": 32}
    config = {
        "step_scheduler": {"max_steps": 4, "val_check_interval": 4, "checkpoint_interval": 4},
        "rng": {"seed": 7},
        "model": {"_target_": "automodel_llm.AutoModelForSequenceClassification.from_config", "config": BERT,
                  "num_labels": 2},
        "tokenizer": {"pretrained_model_name_or_path": str(TOKENIZER_DIR)},
        "dataset": {"_target_": "automodel_llm.datasets.SequenceClassificationDataset", **claims},
        "validation_dataset": {"_target_": "automodel_llm.datasets.SequenceClassificationDataset", **claims,
                               "path_or_dataset_id": str(CLAIMS / "validation.jsonl"), "num_samples_limit": 40},
        "dataloader": {"batch_size": 8},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1.0e-3},
        "checkpoint": {"checkpoint_dir": str(tmp_path / "ckpt")},
    }
    for key, value in sections.items():
        if value is None:
            config.pop(key, None)
        elif isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _last_validation(checkpoint_dir):
    return [json.loads(line) for line in (checkpoint_dir / "validation.jsonl").read_text().splitlines()][-1]


def _score(model, tokenizer, rows):
    """(mean cross-entropy, accuracy) of ``model`` on ``rows``, one row at a time: outside the engine entirely."""
    losses, correct = [], 0
    with torch.no_grad():
        for row in rows:
            encoded = tokenizer(row["context"], row["claim"], truncation=True, max_length=32, return_tensors="pt")
            logits = model(**encoded).logits[0]
            losses.append(torch.nn.functional.cross_entropy(logits[None].float(), torch.tensor([row["label"]])))
            correct += int(logits.argmax().item() == row["label"])
    return torch.stack(losses).mean().item(), correct / len(rows)


def _validation_rows(limit=40):
    return [json.loads(line) for line in (CLAIMS / "validation.jsonl").read_text().splitlines()][:limit]


# ---- metrics and data ------------------------------------------------------------------------------------------

def test_metrics_equal_hand_counts():
    # two classes: predictions 1 1 0 0 1 against labels 1 0 0 1 1 (one ignored): class 1 has tp 2, 3 predicted,
    # 3 actual -> F1 2/3; accuracy 3/5
    logits = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 0], [0, 1], [1, 0]], dtype=torch.float)
    labels = torch.tensor([1, 0, 0, 1, 1, -100])
    metrics = classification_metrics(class_counts(logits, labels))
    assert metrics == pytest.approx({"accuracy": 3 / 5, "f1": 2 / 3})
    # three classes, predictions 0 1 1 2 against labels 0 1 2 1: class 0 F1 1; class 1 tp 1, 2 predicted, 2 actual:
    # 2/4; class 2 tp 0: 0 -> macro F1 0.5
    logits = torch.eye(3)[[0, 1, 1, 2]] * 5
    labels = torch.tensor([0, 1, 2, 1])
    metrics = classification_metrics(class_counts(logits, labels) + class_counts(logits[:0], labels[:0]))
    assert metrics["accuracy"] == pytest.approx(2 / 4)
    assert metrics["f1"] == pytest.approx((1 + 2 / 4 + 0) / 3)


def test_pair_rows_are_tokenized_as_the_tokenizer_encodes_a_pair(tmp_path):
    tokenizer = _tokenizer()
    rows = [{"a": "Bren keeps a cat.", "b": "Bren keeps a dog.", "y": 0}, {"a": "Mara wears red.", "b": "x", "y": 3}]
    dataset = SequenceClassificationDataset(str(_write_rows(tmp_path / "d.jsonl", rows)), tokenizer,
                                            text_fields=["a", "b"], label_field="y")
    assert dataset[0]["input_ids"] == tokenizer("Bren keeps a cat.", "Bren keeps a dog.")["input_ids"]
    assert [s["labels"] for s in dataset] == [[0], [3]] and dataset.largest_label == 3
    batch = pad_collate([dataset[0], dataset[1]], pad_token_id=tokenizer.pad_token_id)
    assert batch["labels"].tolist() == [[0], [3]]
    assert batch["attention_mask"].sum(1).tolist() == [len(dataset[0]["input_ids"]), len(dataset[1]["input_ids"])]


def test_pad_collate_pads_token_type_ids_with_zero():
    batch = pad_collate([{"input_ids": [5, 6, 7], "token_type_ids": [0, 1, 1], "labels": [1]},
                         {"input_ids": [5], "token_type_ids": [0], "labels": [0]}])
    assert batch["token_type_ids"].tolist() == [[0, 1, 1], [0, 0, 0]]


def test_unlabelled_or_unknown_columns_are_refused_naming_the_row(tmp_path):
    tokenizer = _tokenizer()
    path = _write_rows(tmp_path / "test.jsonl", [{"text": "Bren keeps a cat.", "label": 1},
                                                 {"text": "Mara wears red.", "label": -1}])
    with pytest.raises(AutomodelError, match=r"row 2 of .*'label' is -1, not a class index"):
        SequenceClassificationDataset(str(path), tokenizer)
    assert len(SequenceClassificationDataset(str(path), tokenizer, on_bad_row="skip")) == 1
    with pytest.raises(AutomodelError, match=r"no column 'sentence'; its columns: text, label"):
        SequenceClassificationDataset(str(path), tokenizer, text_fields="sentence")


def test_mock_rows_are_seeded_and_in_range():
    first, again = MockSequenceClassificationDataset(seed=3), MockSequenceClassificationDataset(seed=3)
    assert [s["input_ids"] for s in first] == [s["input_ids"] for s in again]
    assert {s["labels"][0] for s in MockSequenceClassificationDataset(num_labels=3)} == {0, 1, 2}
    assert all(4 <= len(s["input_ids"]) <= 32 and max(s["input_ids"]) < 256 for s in first)


# ---- runs, and what loads their outputs --------------------------------------------------------------------------

def test_trained_classifier_loads_in_transformers_with_the_runs_validation_numbers(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    train_inprocess(_config(tmp_path), route=ROUTE)
    record = _last_validation(tmp_path / "ckpt")
    model_dir = tmp_path / "ckpt" / "epoch_0_step_4" / "model"
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    loss, accuracy = _score(model, AutoTokenizer.from_pretrained(str(model_dir)), _validation_rows())
    assert record["num_label_tokens"] == 40
    assert record["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert record["accuracy"] == pytest.approx(accuracy)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_a_lora_checkpoint_with_its_head_resumes_exactly(tmp_path, dora):
    """peft saves the head it trains whole under the head's own name (``classifier.weight``) beside the adapters
    (and DoRA's magnitudes without their adapter name): a resume reads them back, then trains as the run that never
    stopped."""
    config = _config(tmp_path, peft={"target_modules": ["*.query", "*.value"], "dim": 4, "use_dora": dora},
                     step_scheduler={"checkpoint_interval": 2, "log_interval": 1})
    train_inprocess(config, route=ROUTE)
    train_inprocess(config, "--checkpoint.checkpoint_dir", tmp_path / "resumed", "--restore_from.path",
                    tmp_path / "ckpt" / "epoch_0_step_2", route=ROUTE)
    losses = [record["loss"] for record in read_jsonl(tmp_path / "ckpt" / "training.jsonl")]
    assert len(losses) == 4
    assert [record["loss"] for record in read_jsonl(tmp_path / "resumed" / "training.jsonl")] == losses[2:]


def test_lora_adapter_with_its_head_loads_in_peft_over_a_headless_base(tmp_path):
    """Upstream's form: LoRA on a base checkpoint without the classifier (its skip_task_head_prefixes_for_base_model
    names the head); peft trains the head whole and saves it with the adapter."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModel.from_config(AutoConfig.for_model(**BERT)).save_pretrained(str(base))  # a BertModel: no classifier
    config = _config(tmp_path, model={"_target_": "automodel_llm.AutoModelForSequenceClassification.from_pretrained",
                                      "config": None, "pretrained_model_name_or_path": str(base)},
                     peft={"target_modules": ["*.query", "*.value"], "dim": 4, "alpha": 8},
                     checkpoint={"skip_task_head_prefixes_for_base_model": ["classifier."]})
    result = run_cli("finetune", "seq-cls", "-c", config, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "classifier. (2 tensors) start from their fresh initialisation (the base checkpoint in" in result.stderr
    adapter = tmp_path / "ckpt" / "epoch_0_step_4" / "model"
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["base_model_name_or_path"] == str(base.resolve())
    loaded = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=2),
                                       str(adapter)).eval()
    loss, accuracy = _score(loaded, AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)), _validation_rows())
    record = _last_validation(tmp_path / "ckpt")
    assert record["val_loss"] == pytest.approx(loss, rel=1e-5) and record["accuracy"] == pytest.approx(accuracy)

    merged = run_cli("export", tmp_path / "ckpt", tmp_path / "merged", cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert "AutoModelForSequenceClassification.from_pretrained" in merged.stdout
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "merged")).eval()
    assert _score(model, AutoTokenizer.from_pretrained(str(tmp_path / "merged")), _validation_rows()) == \
        pytest.approx((loss, accuracy), rel=1e-4)


UPSTREAM_FORM = {  # upstream's own forms: recipe name, NeMoAuto class, config _target_, file-form mock data target
    "recipe": "TrainFinetuneRecipeForSequenceClassification",
    "step_scheduler": {"global_batch_size": 4, "local_batch_size": 4, "ckpt_every_steps": 3, "val_every_steps": 3,
                       "num_epochs": 1, "max_steps": 3},
    "dist_env": {"backend": "nccl", "timeout_minutes": 1},
    "model": {"_target_": "nemo_automodel.NeMoAutoModelForSequenceClassification.from_config",
              "torch_dtype": "float32",
              "config": {"_target_": "transformers.BertConfig", "num_hidden_layers": 1, "num_attention_heads": 2,
                         "hidden_size": 32, "intermediate_size": 64, "vocab_size": 256,
                         "max_position_embeddings": 64, "num_labels": 3, "hidden_dropout_prob": 0.0,
                         "attention_probs_dropout_prob": 0.0}},
    "distributed": {"strategy": "fsdp2", "dp_size": None, "tp_size": 1, "cp_size": 1, "sequence_parallel": False},
    "dataset": {"_target_": "nemo_automodel/components/datasets/llm/mock_seq_cls.py:MockSequenceClassificationDataset",
                "num_samples": 24, "num_labels": 3, "vocab_size": 256, "max_seq_len": 16},
    "validation_dataset": {"_target_": "nemo_automodel.components.datasets.llm.mock_seq_cls."
                                       "MockSequenceClassificationDataset", "num_samples": 12, "num_labels": 3,
                           "seed": 1},
    "dataloader": {"_target_": "torchdata.stateful_dataloader.StatefulDataLoader",
                   "collate_fn": "nemo_automodel.components.datasets.utils.default_collater", "shuffle": False},
    "validation_dataloader": {"collate_fn": "nemo_automodel.components.datasets.utils.default_collater"},
    "optimizer": {"_target_": "torch.optim.Adam", "lr": 1.0e-3},
    "checkpoint": {"enabled": True, "checkpoint_dir": "ckpt/", "model_save_format": "safetensors",
                   "save_consolidated": True},
}


@pytest.mark.parametrize("command", [("run",), ("finetune", "seq-cls")], ids=["run", "finetune"])
def test_upstream_forms_run(tmp_path, command):
    config = tmp_path / "upstream.yaml"
    config.write_text(yaml.safe_dump(UPSTREAM_FORM), encoding="utf-8")
    result = run_cli(*command, "-c", config, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    record = _last_validation(tmp_path / "ckpt")
    assert record["step"] == 3 and record["num_label_tokens"] == 12 and 0 <= record["f1"] <= 1
    assert (tmp_path / "ckpt" / "epoch_0_step_3" / "model" / "config.json").is_file()


def test_two_ranks_train_and_validate_like_one_process(tmp_path):
    """FSDP2 over two ranks from a headless base with ranked seeds (upstream's rng.ranked: true): the new head is
    initialised alike on every rank (the one process's), so the losses are one process's; each rank validates half
    of the rows and the accuracy / F1 counts are summed."""
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    bert = {k: v for k, v in UPSTREAM_FORM["model"]["config"].items() if k not in ("_target_", "num_labels")}
    AutoModel.from_config(AutoConfig.for_model("bert", **bert)).save_pretrained(str(tmp_path / "base"))
    form = {**UPSTREAM_FORM, "rng": {"seed": 3, "ranked": True},
            "model": {"_target_": "nemo_automodel.NeMoAutoModelForSequenceClassification.from_pretrained",
                      "pretrained_model_name_or_path": str(tmp_path / "base"), "num_labels": 3}}
    config = tmp_path / "upstream.yaml"
    config.write_text(yaml.safe_dump(form), encoding="utf-8")
    one = run_cli("run", "-c", config, "--checkpoint.checkpoint_dir", "one", cwd=tmp_path)
    two = run_cli("run", "-c", config, "--checkpoint.checkpoint_dir", "two", "--nproc-per-node", "2",
                  "--step_scheduler.local_batch_size", "2", cwd=tmp_path, OMP_NUM_THREADS="1")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    assert read_jsonl(tmp_path / "two" / "training.jsonl")[-1]["loss"] == \
        pytest.approx(read_jsonl(tmp_path / "one" / "training.jsonl")[-1]["loss"], rel=1e-5)
    expected, got = _last_validation(tmp_path / "one"), _last_validation(tmp_path / "two")
    assert got["num_label_tokens"] == expected["num_label_tokens"] == 12
    for key in ("val_loss", "accuracy", "f1"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4), key


# ---- refusals ------------------------------------------------------------------------------------------------

def test_a_label_beyond_the_head_is_refused_before_training(tmp_path):
    rows = _write_rows(tmp_path / "three.jsonl", [{"text": "Bren keeps a cat.", "label": 2}] * 4)
    config = _config(tmp_path, dataset={"path_or_dataset_id": str(rows), "text_fields": "text"},
                     validation_dataset=None)
    with pytest.raises(AutomodelError, match=r"dataset: a row's label is 2, but the model's head has 2 classes .* "
                                             r"set model.num_labels: 3"):
        train_inprocess(config, route=ROUTE, setup_only=True)


def test_skipping_a_head_the_base_holds_is_refused(tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    base = tmp_path / "with_head"
    AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**BERT, num_labels=2)).save_pretrained(
        str(base))
    model = {"_target_": "automodel_llm.AutoModelForSequenceClassification.from_pretrained", "config": None,
             "pretrained_model_name_or_path": str(base)}
    config = _config(tmp_path, model=model, checkpoint={"skip_task_head_prefixes_for_base_model": ["classifier."]})
    with pytest.raises(AutomodelError, match=r"the base checkpoint in .* holds 2 tensors of the head "
                                             r"\(classifier.bias, classifier.weight\)"):
        train_inprocess(config, route=ROUTE, setup_only=True)
    config = _config(tmp_path, checkpoint={"skip_task_head_prefixes_for_base_model": ["score."]})
    with pytest.raises(AutomodelError, match=r"no parameter of BertForSequenceClassification starts with 'score.'"):
        train_inprocess(config, route=ROUTE, setup_only=True)


def test_validation_refusals(tmp_path):
    from automodel.testing import run_cli_inprocess

    glue = _config(tmp_path, "glue.yaml", dataset={"_target_": "nemo_automodel.components.datasets.llm.seq_cls."
                                                               "GLUE_MRPC", "trust_remote_code": True})
    result = run_cli_inprocess("validate", "finetune", "seq-cls", "-c", glue, cwd=tmp_path)
    assert result.returncode == 2
    assert "dataset.trust_remote_code: true would let datasets run a loading script" in result.stderr
    lm = _config(tmp_path, "lm.yaml", model={"_target_": "automodel_llm.AutoModelForCausalLM.from_config"})
    result = run_cli_inprocess("validate", "finetune", "seq-cls", "-c", lm, cwd=tmp_path)
    assert result.returncode == 2 and "builds a language model, not a sequence classifier" in result.stderr
    # the key stays refused for the recipes without a task head
    llm = _config(tmp_path, "llm.yaml", checkpoint={"skip_task_head_prefixes_for_base_model": ["classifier."]})
    result = run_cli_inprocess("validate", "finetune", "llm", "-c", llm, cwd=tmp_path)
    assert result.returncode == 2 and "skip_task_head_prefixes_for_base_model" in result.stderr
