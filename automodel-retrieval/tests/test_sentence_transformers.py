"""sentence-transformers round trip: a bi-encoder checkpoint is a sentence-transformers model that embeds as the
recipe does (shared and separate encoders), and a bi-encoder started from a sentence-transformers directory keeps
its pooling, normalisation and max_seq_length unless the config overrides them."""

from __future__ import annotations

import json

import pytest
import torch
from retrieval_testing import (
    BERT_CONFIG,
    BI_ENCODER,
    DOCUMENTS,
    QUERIES,
    TOKENIZER_DIR,
    assert_same_embeddings,
    latest,
    recipe_embeddings,
    run_inprocess,
    st_modules,
    write_config,
)

sentence_transformers = pytest.importorskip("sentence_transformers", reason="pip install 'automodel-retrieval[test]'")

def test_two_encoder_checkpoint_holds_two_sentence_transformers_models(bi_encoder_run):
    """Separate encoders: query_encoder/ and document_encoder/ each load with SentenceTransformer, mean pooling
    and Normalize as trained, and embed their side's texts exactly as the recipe does."""
    recipe = bi_encoder_run["recipe"]
    model_dir = latest(bi_encoder_run["ckpt"]) / "model"
    for side, name, texts in (("query", "query_encoder", QUERIES), ("document", "document_encoder", DOCUMENTS)):
        where = model_dir / name
        assert st_modules(where) == ["Transformer", "Pooling", "Normalize"]
        assert (where / "2_Normalize").is_dir()
        loaded = sentence_transformers.SentenceTransformer(str(where), device="cpu")
        assert loaded[1].pooling_mode == "mean" and loaded.similarity_fn_name == "cosine"
        assert loaded.max_seq_length == recipe.input_settings()[f"{side}_max_length"]
        assert_same_embeddings(loaded.encode(texts, convert_to_tensor=True), recipe_embeddings(recipe, side, texts))


def test_shared_checkpoint_is_one_sentence_transformers_model_with_its_pooling_and_prompts(tmp_path):
    """A shared, cls-pooled, unnormalised bi-encoder with prefixes: no Normalize module, cls pooling, the
    prefixes as the 'query' / 'document' prompts, so encode_query / encode_document equal the recipe's."""
    config = write_config(tmp_path / "cfg.yaml", BI_ENCODER, tmp_path / "ckpt", validation_dataset=None,
                          step_scheduler={"max_steps": 2},
                          model={"shared": True, "pooling": "cls", "normalize": False},
                          retrieval={"query_prefix": "query: ", "document_prefix": "passage: "})
    recipe = run_inprocess("bi", config)
    model_dir = latest(tmp_path / "ckpt") / "model"
    assert st_modules(model_dir) == ["Transformer", "Pooling"] and not (model_dir / "2_Normalize").exists()
    loaded = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
    assert loaded[1].pooling_mode == "cls" and loaded.similarity_fn_name == "dot"
    assert loaded.prompts == {"query": "query: ", "document": "passage: "}
    assert_same_embeddings(loaded.encode_query(QUERIES, convert_to_tensor=True),
                           recipe_embeddings(recipe, "query", QUERIES))
    assert_same_embeddings(loaded.encode_document(DOCUMENTS, convert_to_tensor=True),
                           recipe_embeddings(recipe, "document", DOCUMENTS))


@pytest.fixture(scope="module")
def st_model_dir(tmp_path_factory):
    """A sentence-transformers model written by sentence-transformers itself: the tiny BERT with cls pooling, no
    normalisation, max_seq_length 12."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    root = tmp_path_factory.mktemp("st")
    torch.manual_seed(0)
    AutoModel.from_config(AutoConfig.from_pretrained(str(BERT_CONFIG))).save_pretrained(str(root / "hf"))
    AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)).save_pretrained(str(root / "hf"))
    st = sentence_transformers.models
    encoder = st.Transformer(str(root / "hf"), max_seq_length=12)
    pooling = st.Pooling(encoder.get_embedding_dimension(), pooling_mode="cls")
    sentence_transformers.SentenceTransformer(modules=[encoder, pooling], device="cpu").save(str(root / "st"))
    return root / "st"


def _from_st(tmp_path, st_dir, **sections):
    tmp_path.mkdir(exist_ok=True)
    model = {"_target_": "automodel_retrieval.BiEncoder.from_pretrained", "config": None, "pooling": None,
             "pretrained_model_name_or_path": str(st_dir), "shared": True}
    sections = {"model": model, "retrieval": {"query_max_length": None, "document_max_length": None}, **sections}
    config = write_config(tmp_path / "cfg.yaml", BI_ENCODER, tmp_path / "ckpt", validation_dataset=None,
                          tokenizer=None, step_scheduler={"max_steps": 2}, **sections)
    return run_inprocess("bi", config)


def test_a_model_started_from_sentence_transformers_keeps_its_pooling_normalisation_and_length(st_model_dir,
                                                                                              tmp_path):
    original = sentence_transformers.SentenceTransformer(str(st_model_dir), device="cpu")
    recipe = _from_st(tmp_path, st_model_dir)
    model = recipe.model
    assert (model.pooling, model.normalize) == ("cls", False)
    assert recipe.input_settings()["query_max_length"] == 12 and recipe.input_settings()["document_max_length"] == 12
    long_text = " ".join(DOCUMENTS * 3)
    assert recipe.default_collate_fn(False).encode_documents([long_text])["input_ids"].shape[1] == 12
    # the trained checkpoint is again a model that sentence-transformers embeds like the original does
    trained = sentence_transformers.SentenceTransformer(str(latest(tmp_path / "ckpt") / "model"), device="cpu")
    assert trained.max_seq_length == original.max_seq_length == 12
    assert st_modules(latest(tmp_path / "ckpt") / "model") == ["Transformer", "Pooling"]
    assert_same_embeddings(trained.encode([long_text, *QUERIES], convert_to_tensor=True),
                           recipe_embeddings(recipe, "query", [long_text, *QUERIES]))


def test_the_config_overrides_what_the_sentence_transformers_model_says(st_model_dir, tmp_path):
    recipe = _from_st(tmp_path, st_model_dir, retrieval={"query_max_length": 7, "document_max_length": None})
    assert recipe.input_settings()["query_max_length"] == 7 and recipe.input_settings()["document_max_length"] == 12
    overridden = _from_st(tmp_path / "again", st_model_dir,
                          model={"_target_": "automodel_retrieval.BiEncoder.from_pretrained", "config": None,
                                 "pretrained_model_name_or_path": str(st_model_dir), "pooling": "mean",
                                 "normalize": True, "shared": True})
    assert (overridden.model.pooling, overridden.model.normalize) == ("mean", True)
    assert st_modules(latest(tmp_path / "again" / "ckpt") / "model") == ["Transformer", "Pooling", "Normalize"]


def test_sentence_transformers_modules_the_bi_encoder_cannot_reproduce_are_refused(st_model_dir, tmp_path):
    import shutil

    from automodel.errors import AutomodelError
    from automodel_retrieval import BiEncoder

    copy = tmp_path / "dense"
    shutil.copytree(st_model_dir, copy)
    modules = json.loads((copy / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(AutomodelError, match=r"chains \['Transformer', 'Pooling', 'Dense'\]"):
        BiEncoder.from_pretrained(str(copy))
    pooling = json.loads((st_model_dir / "1_Pooling" / "config.json").read_text())
    (copy / "modules.json").write_text(json.dumps(modules[:2]))
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "pooling_mode": "max"}))
    with pytest.raises(AutomodelError, match="mode 'max'.*set model.pooling"):
        BiEncoder.from_pretrained(str(copy))
