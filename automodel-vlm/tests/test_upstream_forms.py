"""Upstream NeMo AutoModel's VLM forms (tests/upstream_forms/): freeze_config, upstream's collate functions and
data set factories, processor forms; each acts, or is refused at validation with its reason."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from vlm_testing import SHAPES

from automodel import testing
from automodel.errors import AutomodelError, ConfigError
from automodel_vlm.datasets import VLMCollator
from automodel_vlm.datasets.question_answer import json_tokens, receipt_tokens

FORMS = Path(__file__).parent / "upstream_forms"
MEDPIX = FORMS / "finetune_vlm_upstream.yaml"
RDR_CORD = FORMS / "rdr_cord_upstream.yaml"
ROUTE = ("finetune", "vlm")


def _shapes_rows(limit: int = 48):
    rows = [json.loads(line) for line in (SHAPES / "train.jsonl").read_text().splitlines()[:limit]]
    for row in rows:
        question = next(p["text"] for p in row["messages"][0]["content"] if p["type"] == "text")
        answer = row["messages"][1]["content"][0]["text"]
        yield str(SHAPES / row["image"]), question, answer


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def upstream_data(tmp_path_factory):
    """The shipped shapes pictures in the columns of upstream's MedPix, RDR and CORD-v2 data sets."""
    root = tmp_path_factory.mktemp("upstream_vlm_data")
    rows = list(_shapes_rows())
    return {
        "medpix": _write(root / "medpix.jsonl", [{"image_id": i, "question": q, "answer": a} for i, q, a in rows]),
        "rdr": _write(root / "rdr.jsonl", [{"image": i, "text": f"a {a} shape"} for i, _, a in rows]),
        "cord": _write(root / "cord.jsonl", [{"image": i, "ground_truth": json.dumps(
            {"gt_parse": {"shape": {"colour": a, "kind": q}}})} for i, q, a in rows]),
        "shopify": _write(root / "shopify.jsonl", [{"product_image": i, "ground_truth_category": f"Toys > {a} shapes"}
                                                   for i, _, a in rows]),
    }


def _refusals(config: Path, *overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        testing.load_config(config, *overrides, route=ROUTE)
    return {issue.key: issue.message for issue in info.value.issues}


def test_medpix_form_trains_three_steps_with_freeze_config_and_the_collate_function(upstream_data, tmp_path):
    medpix = upstream_data["medpix"]
    recipe = testing.train_inprocess(MEDPIX, "--dataset.path_or_dataset", medpix, "--validation_dataset."
                                     "path_or_dataset", medpix, "--checkpoint.checkpoint_dir", tmp_path, route=ROUTE)
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "training.jsonl")] == [3]
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "validation.jsonl")] == [3]
    assert len(recipe.train_dataset) == 32, "split: train[:32]"
    first = recipe.train_dataset[0]
    question, answer = next(iter(_shapes_rows(1)))[1:]
    assert first["messages"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    model = recipe.model
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all("vision_tower" in n or "embed_tokens" in n for n in frozen)
    assert any("embed_tokens" in n for n in frozen), "freeze_embeddings acts"
    assert any(p.requires_grad for n, p in model.named_parameters() if "language_model.layers" in n)
    collate = recipe.dataloader.collate_fn.fn  # upstream's default_collate_fn: a collator built with the processor
    assert isinstance(collate, VLMCollator) and (collate.processor, collate.max_length) == (recipe.processor, 160)
    batch = collate([recipe.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape == (2, 160), "max_length pads every row to it"


def test_rdr_and_cord_forms_train_with_the_language_model_frozen_but_not_its_head(upstream_data, tmp_path):
    recipe = testing.train_inprocess(RDR_CORD, "--dataset.path_or_dataset", upstream_data["rdr"],
                                     "--validation_dataset.path_or_dataset", upstream_data["cord"],
                                     "--checkpoint.checkpoint_dir", tmp_path, route=ROUTE)
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "validation.jsonl")] == [3]
    model = recipe.model
    language = [p for n, p in model.named_parameters() if "language_model" in n]
    assert language and not any(p.requires_grad for p in language)
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("lm_head"))
    assert any(p.requires_grad for n, p in model.named_parameters() if "vision_tower" in n)
    sample = recipe.train_dataset[0]["messages"]
    assert sample[0]["content"][1]["text"] == "Describe this image." and sample[1]["content"][0]["text"].endswith(
        "shape")
    validation = recipe.val_dataloaders["validation"].dataset
    assert len(validation) == 8
    answer = validation[0]["messages"][1]["content"][0]["text"]
    assert answer.startswith("<s_shape><s_kind>") and answer.endswith("</s_colour></s_shape>")


def test_shopify_catalogue_form_validates_on_product_photos_and_their_category(upstream_data, tmp_path):
    """Upstream's Shopify product-catalogue factory ({product_image, ground_truth_category}): the user shows the
    photo and asks for its category, the assistant answers with it; limit_dataset_samples caps the rows."""
    shopify = "nemo_automodel.components.datasets.vlm.datasets.make_shopify_product_catalogue_dataset"
    testing.train_inprocess(RDR_CORD, "--dataset.path_or_dataset", upstream_data["rdr"],
                            "--validation_dataset._target_", shopify, "--validation_dataset.path_or_dataset",
                            upstream_data["shopify"], "--validation_dataset.limit_dataset_samples", "6",
                            "--checkpoint.checkpoint_dir", tmp_path, route=ROUTE)
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "validation.jsonl")] == [3]
    from automodel_vlm.datasets import make_shopify_product_catalogue_dataset

    data = make_shopify_product_catalogue_dataset(str(upstream_data["shopify"]), limit_dataset_samples=6)
    image, _, answer = next(iter(_shapes_rows(1)))
    assert len(data) == 6 and data[0]["messages"] == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which product category is this "
                                                                                 "item in?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": f"Toys > {answer} shapes"}]}]
    assert len(data[0]["images"]) == 1
    with pytest.raises(AutomodelError, match="has no column product_image, ground_truth_category"):
        make_shopify_product_catalogue_dataset(str(upstream_data["rdr"]))


def test_receipt_tokens_as_upstreams_json_to_token_rule():
    assert json_tokens({"b": "1", "a": [{"x": 2}, "y"], "text_sequence": "ignored"}) == \
        "<s_text_sequence>ignored</s_text_sequence><s_b>1</s_b><s_a><s_x>2</s_x><sep/>y</s_a>"
    assert json_tokens({"text_sequence": "plain"}) == "plain"
    truth = json.dumps({"gt_parses": [{"k": "one"}, {"k": "two"}]})
    random.seed(0)
    picks = {receipt_tokens(truth) for _ in range(20)}
    assert picks == {"<s_k>one</s_k>", "<s_k>two</s_k>"}
    with pytest.raises(AutomodelError, match="neither gt_parses"):
        receipt_tokens(json.dumps({"other": 1}))


def test_a_factory_names_the_columns_it_reads(tmp_path):
    from automodel_vlm.datasets import make_medpix_dataset

    with pytest.raises(AutomodelError, match=r"has no column image_id, question, answer \(it has: image, messages\)"):
        make_medpix_dataset(str(SHAPES / "train.jsonl"))


def test_drop_overlong_leaves_long_samples_out(upstream_data):
    from automodel.testing import load_config

    recipe_cls, cfg = load_config(RDR_CORD, "--dataset.path_or_dataset", upstream_data["rdr"],
                                  "--validation_dataset.path_or_dataset", upstream_data["cord"], route=ROUTE)
    recipe = recipe_cls(cfg)
    recipe.setup_domain()
    from automodel_vlm.datasets import make_rdr_dataset

    data = make_rdr_dataset(str(upstream_data["rdr"]))
    samples = [data[0], data[1]]
    samples[1] = {**samples[1], "messages": [samples[1]["messages"][0], {
        "role": "assistant", "content": [{"type": "text", "text": "very long " * 60}]}]}
    full = VLMCollator(recipe.processor)(samples)
    short = VLMCollator(recipe.processor, max_length=full["input_ids"].shape[1] - 10, drop_overlong=True)(samples)
    assert short["input_ids"].shape[0] == 1 and torch.equal(short["labels"][0][short["attention_mask"][0] == 1],
                                                            full["labels"][0][full["attention_mask"][0] == 1])
    with pytest.raises(AutomodelError, match="needs max_length"):
        VLMCollator(recipe.processor, drop_overlong=True)


@pytest.mark.parametrize("override,key,needle", [
    (("--dataset._target_", "nemo_automodel.components.datasets.vlm.datasets.make_meta_dataset"),
     "dataset._target_", "use ImageTextChatDataset"),
    (("--dataloader.collate_fn._target_", "nemo_automodel.components.datasets.vlm.collate_fns."
                                          "kimi_vl_collate_fn"), "dataloader.collate_fn._target_",
     "only as the checkpoint's own remote code"),
    (("--dataloader.collate_fn.max_lenght", "7"), "dataloader.collate_fn.max_lenght", "max_length"),
    (("--processor.video_processor", "{_target_: transformers.models.qwen3_vl.video_processing_qwen3_vl."
                                     "Qwen3VLVideoProcessor.from_pretrained, max_frame: 8}"),
     "processor.video_processor.max_frame", "has no setting 'max_frame'"),
    (("--freeze.vision_tower", "true"), "freeze_config", "give one of freeze"),
    (("--packed_sequence", "{pack_size: 4096, post_tokenize_hook_fn: automodel_vlm.datasets.gemma4.marker_ends}"),
     "packed_sequence.post_tokenize_hook_fn", "the only hook on tokenized samples here is Gemma 4's"),
    (("--dataloader.collate_fn._target_", "nemo_automodel.components.datasets.vlm.collate_fns."
                                          "phi4_mm_collate_fn"), "dataloader.collate_fn._target_", "audio"),
    (("--freeze_config.freeze_vision_towr", "true"), "freeze_config.freeze_vision_towr", "freeze_vision_tower"),
    (("--model.num_nextn_predict_layers", "1"), "model.num_nextn_predict_layers", "this model is llava"),
    (("--model.text_config", "{cp_full_attn_backend: ffpa}"), "model.text_config.cp_full_attn_backend",
     "FFPA's CUDA kernels"),
])
def test_upstream_names_and_keys_that_cannot_act_are_refused_with_the_reason(override, key, needle):
    found = _refusals(MEDPIX, "--dataset.path_or_dataset", "x", *override)
    assert key in found and needle in found[key], found


def test_processor_form_autoprocessor_with_kwargs_trains(tmp_path):
    from vlm_testing import IMAGE_PROCESSOR_DIR, TOKENIZER_DIR

    from automodel_vlm.processor import build_processor

    saved = tmp_path / "processor"
    build_processor(str(IMAGE_PROCESSOR_DIR), str(TOKENIZER_DIR), patch_size=8, vision_feature_select_strategy=
                    "default", num_additional_image_tokens=1).save_pretrained(str(saved))
    recipe = testing.train_inprocess(FORMS / "processor_upstream.yaml", "--processor.pretrained_model_name_or_path",
                                     saved, "--checkpoint.checkpoint_dir", tmp_path / "ckpt",
                                     "--dataset.limit_dataset_samples", 16, route=ROUTE)
    assert recipe.processor.tokenizer.padding_side == "right"
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [3]


def test_upstreams_gemma4_tensor_parallel_fused_loss_is_the_linear_cross_entropy(upstream_data):
    """Upstream's Gemma 4 TP fused loss (a FusedLinearCrossEntropy gathering a tied, vocabulary-sharded head) is the
    core's LinearCrossEntropy, vocabulary-parallel under tensor parallelism, with its keys acting."""
    from automodel.training.linear_ce import LinearCrossEntropy

    medpix = upstream_data["medpix"]
    _, cfg = testing.load_config(MEDPIX, "--dataset.path_or_dataset", medpix, "--validation_dataset.path_or_dataset",
                                 medpix, "--loss_fn", "{_target_: nemo_automodel.components.models.gemma4_moe."
                                 "loss.Gemma4TensorParallelFusedLinearCrossEntropy, logit_softcapping: 30.0, "
                                 "reduction: sum}", route=ROUTE)
    loss = cfg.loss_fn.instantiate()
    assert isinstance(loss, LinearCrossEntropy) and loss.logit_softcapping == 30.0
