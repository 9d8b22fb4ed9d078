"""Upstream's legacy data form (legacy_data.py): a data set inside its loader (``dataloader.dataset``,
``validation_dataloader.dataset``, upstream's ``make_retrieval_dataset``) builds the same data set as the
``dataset:`` / ``validation_dataset:`` form with the same keys, so a run trains with the same losses; giving the
data set both ways, or none, is refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from retrieval_testing import BERT_CONFIG, BI_ENCODER, CROSS_ENCODER, DATA, write_config

from automodel import testing
from automodel.errors import ConfigError

LEGACY = Path(__file__).parent / "upstream_forms" / "distill_legacy_upstream.yaml"
MAKE = "nemo_automodel.components.datasets.llm.make_retrieval_dataset"
CONFIG = "nemo_automodel.components.datasets.llm.retrieval_dataset.RetrievalDatasetConfig"
ROUTES = {"bi_encoder": ("finetune", "retrieval"), "cross_encoder": ("finetune", "cross-encoder")}
BASES = {"bi_encoder": BI_ENCODER, "cross_encoder": CROSS_ENCODER}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Inline rows {question, pos_doc, neg_doc} for training and validation, a saved tiny student (64 wide) and a
    wider teacher (96)."""
    from transformers import AutoConfig, AutoModel

    root = tmp_path_factory.mktemp("legacy_dataset")
    rows = testing.read_jsonl(DATA / "train.jsonl")
    for name, part in (("train.jsonl", rows[:32]), ("eval.jsonl", rows[32:44])):
        (root / name).write_text("".join(json.dumps({"question": r["query"], "pos_doc": [{"text": r["positive"]}],
                                                     "neg_doc": r["negatives"][:2]}) + "\n" for r in part))
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(BERT_CONFIG))
    AutoModel.from_config(config).save_pretrained(str(root / "student"))
    config.hidden_size, config.intermediate_size = 96, 192
    AutoModel.from_config(config).save_pretrained(str(root / "teacher"))
    return root


def _data(inputs: Path, model_type: str, data_type: str, target: str) -> dict:
    name = "train.jsonl" if data_type == "train" else "eval.jsonl"
    return {"_target_": target, "model_type": model_type, "n_passages": 3, "seed": 7, "do_shuffle": True,
            "data_type": data_type, "data_dir_list": [str(inputs / name)]}


def _configs(tmp_path: Path, inputs: Path, model_type: str) -> tuple[Path, Path]:
    """The same run in both forms: data sets as sections, and inside their loaders (no dataset sections)."""
    base = {k: v for k, v in BASES[model_type].items() if k not in ("dataset", "validation_dataset")}
    steps = {"max_steps": 2, "val_every_steps": 2}
    sections = write_config(tmp_path / "sections.yaml", base, tmp_path / "sections", step_scheduler=steps,
                            dataloader={"batch_size": 8}, dataset=_data(inputs, model_type, "train", CONFIG),
                            validation_dataset=_data(inputs, model_type, "eval", CONFIG))
    legacy = write_config(tmp_path / "legacy.yaml", base, tmp_path / "legacy", step_scheduler=steps,
                          dataloader={"batch_size": 8, "dataset": _data(inputs, model_type, "train", MAKE)},
                          validation_dataloader={"dataset": _data(inputs, model_type, "eval", MAKE)})
    return sections, legacy


@pytest.mark.parametrize("model_type", ["bi_encoder", "cross_encoder"])
def test_the_legacy_form_trains_and_validates_as_the_dataset_form(inputs, tmp_path, model_type):
    sections, legacy = _configs(tmp_path, inputs, model_type)
    ran = {form: testing.train_inprocess(config, route=ROUTES[model_type])
           for form, config in (("sections", sections), ("legacy", legacy))}
    assert ran["legacy"].train_dataset.examples == ran["sections"].train_dataset.examples
    assert len(ran["legacy"].train_dataset) == 32 and len(ran["legacy"].train_dataset[0]["negatives"]) == 2
    assert ran["legacy"].dataloader.dataset is ran["legacy"].train_dataset
    assert list(ran["legacy"].val_dataloaders) == ["validation"]
    assert len(ran["legacy"].val_dataloaders["validation"].dataset) == 12, "validation_dataloader.dataset"
    losses = {form: testing.losses_by_step(tmp_path / form / "training.jsonl") for form in ran}
    assert list(losses["legacy"]) == [1, 2] and losses["legacy"] == losses["sections"]
    validation = {form: testing.read_jsonl(tmp_path / form / "validation.jsonl") for form in ran}
    assert validation["legacy"][0]["step"] == 2
    assert {k: v for k, v in validation["legacy"][0].items() if "time" not in k} == \
        {k: v for k, v in validation["sections"][0].items() if "time" not in k}


def test_upstreams_legacy_distillation_form_trains_as_the_dataset_form(inputs, tmp_path):
    """`kd retrieval` with upstream's legacy distillation layout (distill_legacy_upstream.yaml), against the same
    config with its data set moved to `dataset:`."""
    data = yaml.safe_load(LEGACY.read_text())
    moved = copy.deepcopy(data)
    moved["dataset"] = moved["dataloader"].pop("dataset")
    moved["dataset"]["_target_"] = CONFIG
    sections = testing.write_yaml(tmp_path / "sections.yaml", moved)
    common = ["--model.pretrained_model_name_or_path", inputs / "student", "--teacher_model."
              "pretrained_model_name_or_path", inputs / "teacher", "--step_scheduler.max_steps", "2",
              "--step_scheduler.log_interval", "1"]
    data_list = f"[{inputs / 'train.jsonl'}]"
    route = ("kd", "retrieval")
    legacy = testing.train_inprocess(LEGACY, *common, "--dataloader.dataset.data_dir_list", data_list,
                                     "--checkpoint.checkpoint_dir", tmp_path / "legacy", route=route)
    testing.train_inprocess(sections, *common, "--dataset.data_dir_list", data_list, "--checkpoint.checkpoint_dir",
                            tmp_path / "sections", route=route)
    assert len(legacy.train_dataset) == 32 and not legacy.val_dataloaders
    losses = {form: testing.losses_by_step(tmp_path / form / "training.jsonl") for form in ("legacy", "sections")}
    assert list(losses["legacy"]) == [1, 2] and losses["legacy"] == losses["sections"]
    plan = legacy.describe_plan(legacy.cfg)
    assert f"dataset: {MAKE} (upstream's legacy dataloader.dataset)" in plan


def _refusals(config: Path, route: tuple[str, str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        testing.load_config(config, route=route)
    return {issue.key: issue.message for issue in info.value.issues}


@pytest.mark.parametrize("given,key,needle", [
    ({"dataloader": {"dataset": "train"}}, "dataloader.dataset", "given twice"),
    ({"validation_dataloader": {"dataset": "eval"}}, "validation_dataloader.dataset", "given twice"),
    ({"dataloader": {"dataset": "bare"}, "dataset": None}, "dataloader.dataset", "with _target_"),
    ({"dataset": None}, "dataset", "required section is missing"),
    ({"dataloader": {"dataset": "cross"}, "dataset": None}, "dataloader.dataset.model_type", "trains a bi_encoder"),
])
def test_the_data_set_given_twice_or_not_at_all_is_refused(inputs, tmp_path, given, key, needle):
    nodes = {"train": _data(inputs, "bi_encoder", "train", MAKE), "eval": _data(inputs, "bi_encoder", "eval", MAKE),
             "bare": {k: v for k, v in _data(inputs, "bi_encoder", "train", MAKE).items() if k != "_target_"},
             "cross": _data(inputs, "cross_encoder", "train", MAKE)}
    sections = {name: ({k: nodes[v] for k, v in value.items()} if isinstance(value, dict) else value)
                for name, value in given.items()}
    config = write_config(tmp_path / "cfg.yaml", BI_ENCODER, tmp_path / "ckpt", **sections)
    found = _refusals(config, ROUTES["bi_encoder"])
    assert key in found and needle in found[key], found
