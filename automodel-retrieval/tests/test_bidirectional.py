"""Decoder-only backbones (tiny Llama / Qwen3, fresh weights) as retrieval encoders: bidirectional attention as
upstream builds them (``config.is_causal = False``), the pooled cross-encoder, and what sentence-transformers
loads of both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from retrieval_testing import BERT_CONFIG, DATA, DOCUMENTS, QUERIES, TOKENIZER_DIR, latest

from automodel import testing
from automodel.errors import AutomodelError, ConfigError
from automodel_retrieval import upstream
from automodel_retrieval.models import BiEncoder, CrossEncoder
from automodel_retrieval.pooled_cross_encoder import PooledCrossEncoder

FORMS = Path(__file__).parent / "upstream_forms"
DECODERS = {
    "llama": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 797, "pad_token_id": 0,
              "max_position_embeddings": 128},
    "qwen3": {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 797,
              "pad_token_id": 0, "max_position_embeddings": 128},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Saved tiny decoders (fresh weights, as AutoModel saves them: no is_causal in config.json) and a BERT."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    root = tmp_path_factory.mktemp("decoders")
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    found = {}
    for name, config in {**DECODERS, "bert": json.loads(BERT_CONFIG.read_text())}.items():
        data = dict(config)
        torch.manual_seed(0)
        model = AutoModel.from_config(AutoConfig.for_model(data.pop("model_type"), **data))
        model.save_pretrained(str(root / name))
        tokenizer.save_pretrained(str(root / name))
        found[name] = root / name
    rows = testing.read_jsonl(DATA / "train.jsonl")[:32]
    inline = root / "train_inline.jsonl"
    inline.write_text("".join(json.dumps({"question": r["query"], "pos_doc": [r["positive"]],
                                          "neg_doc": r["negatives"][:2]}) + "\n" for r in rows))
    found["data"] = inline
    return found


def _first_token(model, encode, ids: list[int]) -> torch.Tensor:
    """The first token's final hidden state / the cls-pooled embedding, for ``ids``."""
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    with torch.no_grad():
        return encode(model.eval(), batch)


def _later_token_changes_first(model, encode) -> bool:
    return not torch.allclose(_first_token(model, encode, [5, 6, 7, 8]), _first_token(model, encode, [5, 6, 7, 9]))


def _bi_cls(model, batch):
    return model.encode("query", batch)


# ---- the bi-encoder ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(DECODERS))
def test_upstreams_bi_encoder_on_a_decoder_attends_both_ways(checkpoints, name):
    causal = BiEncoder.from_pretrained(checkpoints[name], shared=True, pooling="cls")
    assert not _later_token_changes_first(causal, _bi_cls), "a plain decoder checkpoint stays causal natively"
    model = upstream.bi_encoder_from_pretrained(str(checkpoints[name]), pooling="cls")
    assert model.query_encoder.config.is_causal is False
    assert _later_token_changes_first(model, _bi_cls), "the last token changes the first one's embedding"
    native = BiEncoder.from_pretrained(checkpoints[name], shared=True, pooling="cls", bidirectional=True)
    assert _later_token_changes_first(native, _bi_cls)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    with torch.no_grad():
        assert torch.allclose(native.eval().encode("query", batch), model.eval().encode("query", batch))


def test_an_encoder_is_unchanged_and_bidirectional_false_on_it_is_refused(checkpoints):
    model = upstream.bi_encoder_from_pretrained(str(checkpoints["bert"]))
    assert getattr(model.query_encoder.config, "is_causal", None) is None, "nothing written into BERT's config"
    with pytest.raises(AutomodelError, match="bidirectional: false, but BertModel is an encoder"):
        BiEncoder.from_pretrained(checkpoints["bert"], bidirectional=False)


def test_bidirectional_false_makes_a_bidirectional_checkpoint_causal_again(checkpoints, tmp_path):
    BiEncoder.from_pretrained(checkpoints["llama"], shared=True, bidirectional=True).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["is_causal"] is False
    assert _later_token_changes_first(BiEncoder.from_pretrained(tmp_path, pooling="cls"), _bi_cls), \
        "the saved config keeps it bidirectional"
    assert not _later_token_changes_first(BiEncoder.from_pretrained(tmp_path, pooling="cls", bidirectional=False),
                                          _bi_cls)


def test_native_sections_ask_for_it_with_bidirectional(tmp_path):
    """``BiEncoder`` / ``CrossEncoder`` ``.from_config``: causal as the config says unless bidirectional: true."""
    config = tmp_path / "qwen3.json"
    config.write_text(json.dumps(DECODERS["qwen3"]))
    assert not _later_token_changes_first(BiEncoder.from_config(config, shared=True, pooling="cls"), _bi_cls)
    assert _later_token_changes_first(BiEncoder.from_config(config, pooling="cls", bidirectional=True), _bi_cls)
    pooled = CrossEncoder.from_config(config, pooling="cls", bidirectional=True, seed=0)
    assert isinstance(pooled, PooledCrossEncoder) and _later_token_changes_first(pooled, _scores)
    assert not _later_token_changes_first(CrossEncoder.from_config(config, pooling="cls", seed=0), _scores)


def _upstream_bi_overrides(checkpoints, name, checkpoint_dir):
    return ["--model.pretrained_model_name_or_path", checkpoints[name], "--dataset.data_dir_list",
            f"[{checkpoints['data']}]", "--validation_dataset.data_dir_list", f"[{checkpoints['data']}]",
            "--checkpoint.checkpoint_dir", checkpoint_dir, "--step_scheduler.max_steps", "2",
            "--step_scheduler.ckpt_every_steps", "2", "--step_scheduler.val_every_steps", "2"]


@pytest.mark.parametrize("name", list(DECODERS))
def test_upstream_bi_encoder_form_on_a_decoder_trains_and_loads_in_sentence_transformers(checkpoints, name,
                                                                                        tmp_path):
    from sentence_transformers import SentenceTransformer

    recipe = testing.train_inprocess(FORMS / "bi_encoder_upstream.yaml",
                                     *_upstream_bi_overrides(checkpoints, name, tmp_path),
                                     route=("finetune", "retrieval"))
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "training.jsonl")] == [2]
    model_dir = latest(tmp_path) / "model"
    assert json.loads((model_dir / "config.json").read_text())["is_causal"] is False
    model = recipe.model.eval()
    assert _later_token_changes_first(model, _bi_cls)
    texts = QUERIES + DOCUMENTS
    with torch.no_grad():
        ours = model.encode("query", recipe.tokenizer(texts, padding=True, return_tensors="pt"))
    theirs = SentenceTransformer(str(model_dir), device="cpu").encode(texts, convert_to_tensor=True)
    assert torch.allclose(theirs.float().cpu(), ours, atol=1e-5)


# ---- the pooled cross-encoder -----------------------------------------------------------------------------------

def _scores(model, batch):
    return model(**batch).logits


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("pooling", ["avg", "cls", "last"])
def test_upstreams_cross_encoder_with_pooling_is_bidirectional_and_pools(checkpoints, name, pooling):
    model = upstream.cross_encoder_from_pretrained(str(checkpoints[name]), pooling=pooling)
    assert isinstance(model, PooledCrossEncoder) and model.pooling == upstream.POOLINGS[pooling]
    assert model.backbone.config.is_causal is False
    assert _later_token_changes_first(model, _scores), "the first token's state (and so the score) sees the last"
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 0], [5, 6, 7, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])}
    with torch.no_grad():
        hidden = model.backbone(**batch).last_hidden_state
        expected = {"avg": hidden[0, :4].mean(0), "cls": hidden[0, 0], "last": hidden[0, 3]}[pooling]
        assert torch.allclose(model(**batch).logits[0], model.score(expected), atol=1e-6)


def test_cross_encoder_without_pooling_keeps_the_sequence_classifier(checkpoints):
    from transformers import LlamaForSequenceClassification

    model = upstream.cross_encoder_from_pretrained(str(checkpoints["llama"]))
    assert isinstance(model, LlamaForSequenceClassification)


def test_cross_encoder_pooling_values_no_loader_reproduces_are_refused():
    issues = upstream.cross_encoder_issues({"pooling": "weighted_avg"})
    assert [issue.key for issue in issues] == ["model.pooling"] and "avg, cls or last" in issues[0].message
    with pytest.raises(AutomodelError, match="num_labels: 2, but a pooled cross-encoder"):
        CrossEncoder.from_config(BERT_CONFIG, pooling="mean", num_labels=2)


@pytest.mark.parametrize("name", list(DECODERS))
def test_upstream_cross_encoder_form_with_pooling_trains_and_loads_in_sentence_transformers(checkpoints, name,
                                                                                          tmp_path):
    from sentence_transformers import CrossEncoder as STCrossEncoder

    recipe = testing.train_inprocess(FORMS / "cross_encoder_pooled_upstream.yaml",
                                     *_upstream_bi_overrides(checkpoints, name, tmp_path),
                                     route=("finetune", "cross-encoder"))
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "training.jsonl")] == [2]
    assert recipe.loss_fn.temperature == 0.5
    model = recipe.model.eval()
    assert isinstance(model, PooledCrossEncoder) and model.pooling == "mean"
    model_dir = latest(tmp_path) / "model"
    assert json.loads((model_dir / "config.json").read_text())["is_causal"] is False
    pairs = list(zip(QUERIES, DOCUMENTS, strict=True))
    batch = recipe.tokenizer(QUERIES, DOCUMENTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = model(**batch).logits.squeeze(-1)
    loaded = STCrossEncoder(str(model_dir), device="cpu")
    theirs = loaded.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_tensor=True)
    assert torch.allclose(theirs.float().cpu(), ours, atol=1e-5)
    assert torch.allclose(torch.as_tensor(loaded.predict(pairs)), torch.sigmoid(ours), atol=1e-5), "default sigmoid"
    reloaded = CrossEncoder.from_pretrained(str(model_dir)).eval()
    assert isinstance(reloaded, PooledCrossEncoder) and reloaded.pooling == "mean"
    with torch.no_grad():
        assert torch.allclose(reloaded(**batch).logits.squeeze(-1), ours, atol=1e-6)


def test_a_pooled_cross_encoder_resumes_from_its_checkpoint(checkpoints, tmp_path):
    """The resume reads model/ back as the recipe wrote it (backbone + 2_Dense score): equal losses afterwards."""
    form, route = FORMS / "cross_encoder_pooled_upstream.yaml", ("finetune", "cross-encoder")
    steps = ["--step_scheduler.max_steps", "4", "--step_scheduler.val_every_steps", "4",
             "--step_scheduler.log_interval", "1"]
    reference = testing.train_inprocess(form, *_upstream_bi_overrides(checkpoints, "llama", tmp_path / "ref"), *steps,
                                        route=route)
    assert testing.checkpoint_dirs(tmp_path / "ref") == ["epoch_0_step_2", "epoch_0_step_4"]
    resumed = testing.train_inprocess(form, *_upstream_bi_overrides(checkpoints, "llama", tmp_path / "resumed"),
                                      *steps, "--restore_from.path", tmp_path / "ref" / "epoch_0_step_2",
                                      route=route)
    expected = {r["step"]: r["loss"] for r in testing.read_jsonl(tmp_path / "ref" / "training.jsonl")}
    got = {r["step"]: r["loss"] for r in testing.read_jsonl(tmp_path / "resumed" / "training.jsonl")}
    assert sorted(got) == [3, 4] and [got[3], got[4]] == [expected[3], expected[4]]
    for (name, a), b in zip(reference.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_pooled_cross_encoder_has_no_sharded_model_form(checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.save_consolidated: false: a pooled cross-encoder"):
        testing.load_config(FORMS / "cross_encoder_pooled_upstream.yaml",
                            *_upstream_bi_overrides(checkpoints, "llama", tmp_path),
                            "--checkpoint.save_consolidated", "false", route=("finetune", "cross-encoder"))


# ---- upstream's own model type (llama_bidirec, remote code on the hub) -------------------------------------------

def test_a_llama_bidirec_checkpoint_loads_as_bidirectional_llama_without_remote_code(checkpoints, tmp_path):
    """A checkpoint as upstream's LlamaBidirectionalModel saves it (model_type llama_bidirec, auto_map to remote
    code, pooling / temperature in its config): loaded as transformers' Llama attending both ways."""
    import shutil

    from transformers import LlamaModel

    source = tmp_path / "llama_bidirec"
    shutil.copytree(checkpoints["llama"], source)
    config = json.loads((source / "config.json").read_text())
    config.update(model_type="llama_bidirec", architectures=["LlamaBidirectionalModel"], pooling="avg",
                  temperature=1.0, auto_map={"AutoConfig": "llama_bidirectional_model.LlamaBidirectionalConfig",
                                             "AutoModel": "llama_bidirectional_model.LlamaBidirectionalModel"})
    (source / "config.json").write_text(json.dumps(config))
    reference = BiEncoder.from_pretrained(checkpoints["llama"], shared=True, bidirectional=True).eval()
    for model in (upstream.bi_encoder_from_pretrained(str(source)), BiEncoder.from_pretrained(source, shared=True)):
        encoder = model.query_encoder
        assert type(encoder) is LlamaModel and encoder.config.is_causal is False
        assert _later_token_changes_first(model, _bi_cls)
        batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
        with torch.no_grad():
            assert torch.equal(model.eval().encode("query", batch), reference.encode("query", batch))
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["is_causal"] is False and "auto_map" not in saved


def test_upstreams_llama_bidirec_reranker_loads_as_a_pooled_cross_encoder_with_its_score(tmp_path):
    """A checkpoint as upstream's LlamaBidirectionalForSequenceClassification saves it (model.*, score.weight;
    pooling avg in its config): its pooling and score layer, over Llama attending both ways."""
    from transformers import AutoConfig, LlamaForSequenceClassification

    data = dict(DECODERS["llama"])
    torch.manual_seed(0)
    classifier = LlamaForSequenceClassification(AutoConfig.for_model(data.pop("model_type"), num_labels=1, **data))
    classifier.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="llama_bidirec", architectures=["LlamaBidirectionalForSequenceClassification"],
                  pooling="avg", temperature=1.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = upstream.cross_encoder_from_pretrained(str(tmp_path)).eval()
    assert isinstance(model, PooledCrossEncoder) and model.pooling == "mean"
    assert torch.equal(model.score.weight, classifier.score.weight)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 0]])}
    classifier.config.is_causal = False
    with torch.no_grad():
        hidden = classifier.eval().model(**batch).last_hidden_state
        assert torch.allclose(model(**batch).logits, classifier.score(hidden[:, :4].mean(1)), atol=1e-6)
    assert _later_token_changes_first(model, _scores)


@pytest.mark.slow
def test_a_pooled_cross_encoder_on_two_fsdp2_ranks_trains_as_one_process_and_saves_its_layout(checkpoints,
                                                                                            tmp_path):
    """Two gloo ranks with half the batch each: the same losses as one process, and model/ (gathered from the
    shards, written by the recipe) is the sentence-transformers CrossEncoder, with the same weights."""
    from safetensors.torch import load_file

    from automodel.testing import free_port, run_cli

    form = FORMS / "cross_encoder_pooled_upstream.yaml"
    common = [*_upstream_bi_overrides(checkpoints, "llama", tmp_path / "one"), "--step_scheduler.log_interval", "1",
              "--dataloader.shuffle", "false"]
    testing.train_inprocess(form, *common, route=("finetune", "cross-encoder"))
    two_dir = tmp_path / "two"
    two = run_cli("finetune", "cross-encoder", "-c", form, *common, "--checkpoint.checkpoint_dir", two_dir,
                  "--step_scheduler.local_batch_size", 2, "--nproc-per-node", 2, "--master-port", free_port(),
                  cwd=tmp_path, OMP_NUM_THREADS="1")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "sharding [fsdp2]" in two.stderr
    losses = {name: [r["loss"] for r in testing.read_jsonl(tmp_path / name / "training.jsonl")]
              for name in ("one", "two")}
    assert len(losses["one"]) == 2 and losses["two"] == pytest.approx(losses["one"], rel=1e-5)
    one_dir, two_dir = latest(tmp_path / "one") / "model", latest(two_dir) / "model"
    for name in ("model.safetensors", "2_Dense/model.safetensors"):
        ours, theirs = load_file(str(two_dir / name)), load_file(str(one_dir / name))
        assert sorted(ours) == sorted(theirs)
        for key in ours:
            assert torch.allclose(ours[key], theirs[key], atol=1e-5), key
