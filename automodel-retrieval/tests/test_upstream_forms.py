"""Upstream NeMo AutoModel's retrieval forms (tests/upstream_forms/): its model, tokenizer, data set and collator
names with their keys act on ours, or are refused at validation with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from retrieval_testing import BERT_CONFIG, DATA, TOKENIZER_DIR, latest

from automodel import testing
from automodel.errors import AutomodelError, ConfigError

FORMS = Path(__file__).parent / "upstream_forms"
BI = FORMS / "bi_encoder_upstream.yaml"
CROSS = FORMS / "cross_encoder_upstream.yaml"
MINING = FORMS / "mining_upstream.yaml"
BI_ROUTE, CROSS_ROUTE = ("finetune", "retrieval"), ("finetune", "cross-encoder")


@pytest.fixture(scope="module")
def upstream_inputs(tmp_path_factory):
    """A saved tiny BERT encoder, and the shipped rows in upstream's inline format {question, pos_doc, neg_doc}."""
    from transformers import AutoConfig, AutoModel

    root = tmp_path_factory.mktemp("upstream_retrieval")
    torch.manual_seed(0)
    AutoModel.from_config(AutoConfig.from_pretrained(str(BERT_CONFIG))).save_pretrained(str(root / "encoder"))
    rows = testing.read_jsonl(DATA / "train.jsonl")[:64]
    inline = root / "train_inline.jsonl"
    inline.write_text("".join(json.dumps({"question": r["query"], "pos_doc": [{"text": r["positive"]}],
                                          "neg_doc": r["negatives"][:2]}) + "\n" for r in rows))
    return {"encoder": root / "encoder", "data": inline, "rows": rows}


def _overrides(inputs, checkpoint_dir):
    data = str(inputs["data"])
    return ["--model.pretrained_model_name_or_path", inputs["encoder"], "--dataset.data_dir_list", f"[{data}]",
            "--checkpoint.checkpoint_dir", checkpoint_dir]


def test_bi_encoder_form_trains_three_steps_with_upstreams_keys_acting(upstream_inputs, tmp_path):
    data = str(upstream_inputs["data"])
    recipe = testing.train_inprocess(BI, *_overrides(upstream_inputs, tmp_path), "--validation_dataset."
                                     "data_dir_list", f"[{{path: {data}, num_samples: 16}}]", route=BI_ROUTE)
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "training.jsonl")] == [3]
    validation = testing.read_jsonl(tmp_path / "validation.jsonl")
    assert [r["step"] for r in validation] == [3] and "recall@1" in validation[0]
    model = recipe.model
    assert model.shared and model.pooling == "mean" and model.normalize, "one encoder, avg pooling, l2_normalize"
    assert model.query_encoder.config._attn_implementation == "sdpa"
    assert recipe.loss_fn.temperature == 0.05, "top-level temperature"
    first, rows = recipe.train_dataset[0], upstream_inputs["rows"]
    assert first["negatives"] == [rows[0]["negatives"][0], rows[0]["negatives"][1], rows[0]["negatives"][0]], \
        "n_passages 4: three negatives, the row's two repeated in turn"
    assert len(recipe.val_dataloaders["validation"].dataset) == 16, "{path, num_samples: 16}"
    assert len(recipe.val_dataloaders["validation"].dataset[0]["negatives"]) == 2, "eval_negative_size"
    collator = recipe.dataloader.collate_fn.fn
    assert (collator.query_max_length, collator.document_max_length, collator.query_prefix) == (32, 48, "query: ")
    batch = collator([recipe.train_dataset[i] for i in range(3)])
    assert batch["query"]["input_ids"].shape[1] % 8 == 0, "pad_to_multiple_of"
    assert recipe.settings.query_max_length == 32, "validation embeds as training does"
    saved = json.loads((latest(tmp_path) / "model" / "bi_encoder_config.json").read_text())
    assert saved["query_prefix"] == "query: " and saved["shared"] is True


def test_cross_encoder_form_trains_with_the_prompt_template_and_the_temperature(upstream_inputs, tmp_path):
    data = str(upstream_inputs["data"])
    recipe = testing.train_inprocess(CROSS, *_overrides(upstream_inputs, tmp_path), "--validation_dataset."
                                     "data_dir_list", f"[{data}]", route=CROSS_ROUTE)
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "training.jsonl")] == [3]
    assert recipe.loss_fn.temperature == 0.5, "model.temperature divides the pair scores"
    validation = recipe.val_dataloaders["validation"]
    assert len(validation.dataset) == 16 and validation.collate_fn.fn.prompt_template.startswith("question:")
    batch = recipe.default_collate_fn(True)([recipe.train_dataset[0]])
    text = recipe.tokenizer.decode(batch["pairs"]["input_ids"][0], skip_special_tokens=True)
    assert text.startswith("question") and " passage " in text  # the tiny vocabulary has no ':'
    assert not batch["pairs"]["token_type_ids"].any(), "one sequence from prompt_template, not a text pair"
    assert batch["pairs"]["input_ids"].shape[1] % 8 == 0


def test_mining_form_with_upstreams_keys(upstream_inputs, tmp_path, capsys):
    from automodel.cli.main import main

    run = tmp_path / "run"
    testing.train_inprocess(BI, *_overrides(upstream_inputs, run), "--validation_dataset.data_dir_list",
                            f"[{upstream_inputs['data']}]", "--step_scheduler.val_every_steps", 100,
                            route=BI_ROUTE)
    output = tmp_path / "mined.jsonl"
    code = main(["mine", "retrieval", "-c", str(MINING), "--mining.model_name_or_path", str(run),
                 "--mining.train_qa_file_path", str(DATA / "train.jsonl"), "--mining.train_file_output_path",
                 str(output), "--mining.limit", "24"])
    assert code == 0
    mined = testing.read_jsonl(output)
    assert len(mined) == 24 and all(len(r["negatives"]) <= 3 for r in mined), "hard_negatives_to_mine"
    assert any(len(r["negatives"]) == 3 for r in mined)
    assert "note: section 'dist_env' configures nothing" in capsys.readouterr().err


def test_the_inline_reader_names_what_it_cannot_read(tmp_path):
    from automodel_retrieval.upstream import retrieval_dataset

    corpus_id = tmp_path / "corpus_id.json"
    corpus_id.write_text(json.dumps({"corpus": {"path": "x"}, "data": []}))
    with pytest.raises(AutomodelError, match="has no merlin_metadata.json"):
        retrieval_dataset([str(corpus_id)])
    with pytest.raises(AutomodelError, match="cannot reach offline"):
        retrieval_dataset(["hf://nvidia/embed-nemotron-dataset-v1/FEVER"])
    no_negatives = tmp_path / "no_negatives.jsonl"
    no_negatives.write_text(json.dumps({"query": "q", "pos_doc": "p", "neg_doc": []}) + "\n")
    with pytest.raises(AutomodelError, match="has no neg_doc, but n_passages asks for 4"):
        retrieval_dataset([str(no_negatives)])
    assert len(retrieval_dataset([str(no_negatives)], n_passages=1)[0]["negatives"]) == 0


# the data files the forms leave to each test (SAVED_BY_THE_TEST): validation reads that they exist
SHIPPED_DATA = ["--dataset.data_dir_list", f"[{DATA / 'train.jsonl'}]", "--validation_dataset.data_dir_list",
                f"[{DATA / 'train.jsonl'}]"]


def _refusals(config: Path, route, *overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        testing.load_config(config, "--model.pretrained_model_name_or_path", TOKENIZER_DIR, *SHIPPED_DATA, *overrides,
                            route=route)
    return {issue.key: issue.message for issue in info.value.issues}


@pytest.mark.parametrize("override,key,needle", [
    (("--model.use_liger_kernel", "true"), "model.use_liger_kernel", "Triton kernels need a CUDA GPU"),
    (("--model.attn_implementation", "flash_attention_2"), "model.attn_implementation", "needs a CUDA GPU"),
    (("--model.pooling", "colbert"), "model.pooling", "use avg, cls or last"),
    (("--tokenizer.add_eos_token", "3"), "tokenizer.add_eos_token", "expected true or false"),
    (("--dataset.model_type", "cross_encoder"), "dataset.model_type", "trains a bi_encoder"),
    (("--dataset.cycle_positive_docs", "true"), "dataset.cycle_positive_docs", "first positive"),
    (("--dataloader.collate_fn.padding", "max_length"), "dataloader.collate_fn.padding", "longest"),
    (("--dataloader.collate_fn.use_dataset_instruction", "true"), "dataloader.collate_fn.query_prefix",
     "would not act"),
    (("--dataset.data_dir_list", "[./embed_data/FEVER/FEVER.json]"), "dataset.data_dir_list", "is not a file"),
    (("--dataset.data_dir_list", "[hf://nvidia/embed-nemotron-dataset-v1/FEVER]"), "dataset.data_dir_list",
     "cannot reach offline"),
    (("--temperature", "0"), "temperature", "a number > 0"),
    (("--loss_fn.temperature", "0.1"), "temperature", "the same setting"),
    (("--retrieval.query_max_length", "16"), "retrieval", "not both"),
    (("--dataloader.collate_fn._target_", "nemo_automodel.components.datasets.llm.ProcessorMethodCollator"),
     "dataloader.collate_fn._target_", "LlamaNemotronVL model"),
])
def test_bi_encoder_values_that_cannot_act_are_refused(override, key, needle):
    found = _refusals(BI, BI_ROUTE, *override)
    assert key in found and needle in found[key], found


def test_cross_encoder_poolings_not_implemented_are_refused():
    """avg / cls / last act (test_bidirectional.py); upstream's other bi-encoder poolings have no reranker here."""
    found = _refusals(CROSS, CROSS_ROUTE, "--model.pooling", "weighted_avg")
    assert "use avg, cls or last" in found["model.pooling"]
    testing.load_config(CROSS, "--model.pretrained_model_name_or_path", TOKENIZER_DIR, *SHIPPED_DATA,
                        "--model.pooling", "avg", route=CROSS_ROUTE)


def test_extract_submodel_takes_a_part_of_a_larger_model_as_the_encoder(tmp_path):
    from transformers import T5Config, T5Model

    from automodel_retrieval.upstream import bi_encoder_from_pretrained

    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    T5Model(config).save_pretrained(str(tmp_path / "t5"))
    model = bi_encoder_from_pretrained(str(tmp_path / "t5"), extract_submodel="encoder")
    assert type(model.query_encoder).__name__ == "T5Stack" and model.shared and model.pooling == "mean"
    with pytest.raises(AutomodelError, match="has no part 'nowhere'"):
        bi_encoder_from_pretrained(str(tmp_path / "t5"), extract_submodel="nowhere")


def test_upstreams_dtype_names_build_the_encoder_in_that_dtype(upstream_inputs):
    """`torch_dtype: bf16` (upstream's short name) reached transformers as the string and stopped the build."""
    from automodel_retrieval.upstream import bi_encoder_from_pretrained, cross_encoder_from_pretrained

    encoder = bi_encoder_from_pretrained(str(upstream_inputs["encoder"]), torch_dtype="bf16")
    assert encoder.query_encoder.dtype == torch.bfloat16
    assert cross_encoder_from_pretrained(str(upstream_inputs["encoder"]), torch_dtype="BFloat16").dtype == \
        torch.bfloat16
