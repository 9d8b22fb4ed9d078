"""Embedding distillation (`automodel kd retrieval`): each loss weight adds its loss to the trained loss as the
formula says (checked against the losses written out here from the embeddings), the teacher stays frozen, a run
resumes exactly, the student saves as a sentence-transformers model (its projection beside it), and upstream's
form trains three steps through the CLI."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from retrieval_testing import BERT_CONFIG, BI_ENCODER, DATA, QUERIES, TOKENIZER_DIR, latest, write_config

from automodel import testing
from automodel.errors import ConfigError

ROUTE = ("kd", "retrieval")
# a 1-layer Llama teacher (48 wide, last-token pooling) over the same tokenizer: the BERT student (64 wide) is
# projected 64 -> 48
LLAMA = {"model_type": "llama", "vocab_size": 797, "hidden_size": 48, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "pad_token_id": 0}
DISTILL = {
    **{k: v for k, v in BI_ENCODER.items() if k != "loss_fn"},
    "model": {"_target_": "automodel_retrieval.BiEncoder.from_config", "config": str(BERT_CONFIG), "shared": True,
              "pooling": "mean", "normalize": False, "seed": 1},
    "teacher_model": {"_target_": "automodel_retrieval.BiEncoder.from_config", "config": LLAMA, "shared": True,
                      "pooling": "last", "normalize": False, "seed": 2},
    "dataset": {"path": str(DATA / "train.jsonl"), "num_negatives": 2, "limit_dataset_samples": 32},
    "validation_dataset": None,
    "dataloader": {"batch_size": 8},
    "infonce_distill_loss": {"temperature": 0.05},
}


def _run(tmp_path, weights, **sections):
    """One step with ``weights``; the step's first batch, the student before the step and the logged loss."""
    config = write_config(tmp_path / "cfg.yaml", DISTILL, tmp_path / "ckpt", step_scheduler={"max_steps": 1},
                          **dict(zip(("distill_loss_weight", "mse_loss_weight", "nce_distill_loss_weight"), weights,
                                     strict=True)), **sections)
    seen = {}

    def observe(recipe):
        seen["student"] = copy.deepcopy(recipe.model).eval()
        compute = recipe.compute_loss
        recipe.compute_loss = lambda model, batch: (seen.setdefault("batch", batch), compute(model, batch))[1]

    recipe = testing.train_inprocess(config, route=ROUTE, before_run=observe)
    return recipe, seen, testing.losses_by_step(tmp_path / "ckpt" / "training.jsonl")[1]


def _by_hand(recipe, seen, temperature=0.05):
    """The three losses of the observed batch, written out from the embeddings."""
    student, teacher, batch = seen["student"], recipe.teacher, seen["batch"]
    size = len(batch["labels"])
    with torch.no_grad():
        sq, sd = student.encode("query", batch["query"]), student.encode("document", batch["document"])
        tq, td = teacher.encode("query", batch["query"]), teacher.encode("document", batch["document"])
        weight, bias = student.projection.weight, student.projection.bias
        pq, pd = sq @ weight.T + bias, sd[:size] @ weight.T + bias
    cosine = sum(1 - float(a @ b / (a.norm() * b.norm())) for x, y in ((pq, tq), (pd, td[:size]))
                 for a, b in zip(x, y, strict=True)) / size
    mse = float(((pq - tq) ** 2).mean() + ((pd - td[:size]) ** 2).mean())
    kl = 0.0
    for i in range(size):
        s = [float(F.cosine_similarity(sq[i], d, dim=0)) / temperature for d in sd]
        t = [float(F.cosine_similarity(tq[i], d, dim=0)) / temperature for d in td]
        log_zs, log_zt = math.log(sum(math.exp(v) for v in s)), math.log(sum(math.exp(v) for v in t))
        kl += sum(math.exp(tj - log_zt) * ((tj - log_zt) - (sj - log_zs)) for sj, tj in zip(s, t, strict=True))
    return cosine, mse, kl / size


@pytest.mark.parametrize("weights", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.3, 2.0, 0.7)],
                         ids=["cosine", "mse", "listwise", "mix"])
def test_each_weight_adds_its_loss_as_the_formula_says(tmp_path, weights):
    recipe, seen, logged = _run(tmp_path, weights)
    assert recipe.model.projection.in_features == 64 and recipe.model.projection.out_features == 48
    assert seen["batch"]["document"]["input_ids"].shape[0] == 8 * 3, "positives and two hard negatives each"
    losses = _by_hand(recipe, seen)
    expected = sum(w * v for w, v in zip(weights, losses, strict=True))
    assert min(losses) > 1e-3, losses  # each loss matters: a missing term would show
    assert logged == pytest.approx(expected, rel=1e-4), (logged, losses)


def test_the_teacher_stays_frozen_and_the_student_and_projection_train(tmp_path):
    config = write_config(tmp_path / "cfg.yaml", DISTILL, tmp_path / "ckpt", step_scheduler={"max_steps": 3},
                          mse_loss_weight=1.0)
    before = {}

    def keep(recipe):
        before["teacher"] = copy.deepcopy(recipe.teacher.state_dict())
        before["student"] = copy.deepcopy(recipe.model.state_dict())

    recipe = testing.train_inprocess(config, route=ROUTE, before_run=keep)
    teacher = recipe.teacher
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(v, before["teacher"][k]) for k, v in teacher.state_dict().items())
    changed = [k for k, v in recipe.model.state_dict().items() if not torch.equal(v, before["student"][k])]
    assert "projection.weight" in changed and any(k.startswith("query_encoder.") for k in changed)
    assert all(p.grad is None for p in teacher.parameters())


def test_without_in_batch_negatives_a_query_ranks_only_its_own_documents():
    """use_in_batch_negatives: false: each query's term is the listwise loss over its own positive and hard
    negatives alone (the collator's document_owners)."""
    from automodel_retrieval.distill_losses import InfoNCEDistillLoss

    torch.manual_seed(0)
    sq, sd = torch.randn(2, 8), torch.randn(6, 8)
    tq, td = sq[:, :6] + 0.3 * torch.randn(2, 6), -sd[:, :6]  # a teacher that ranks the other way round
    own = torch.tensor([0, 1, 0, 1, 0, 1]).unsqueeze(0) == torch.arange(2).unsqueeze(1)
    alone = InfoNCEDistillLoss(temperature=0.5)
    per_query = [alone(sq[i:i + 1], sd[[i, i + 2, i + 4]], tq[i:i + 1], td[[i, i + 2, i + 4]]) for i in range(2)]
    value = InfoNCEDistillLoss(temperature=0.5, use_in_batch_negatives=False)(sq, sd, tq, td, candidates=own)
    assert float(value) > 0.1 and float(value) == pytest.approx(float(sum(per_query) / 2), rel=1e-5)
    assert float(alone(sq, sd, tq, td)) != pytest.approx(float(value)), "in-batch negatives widen the candidates"


def test_resume_continues_with_identical_losses_and_projection(tmp_path):
    run = {"step_scheduler": {"max_steps": 4, "checkpoint_interval": 2}, "dataloader": {"batch_size": 8,
                                                                                         "shuffle": True},
           "mse_loss_weight": 1.0, "nce_distill_loss_weight": 0.5}
    config = write_config(tmp_path / "cfg.yaml", DISTILL, tmp_path / "ref", **run)
    reference = testing.train_inprocess(config, route=ROUTE)
    expected = testing.losses_by_step(tmp_path / "ref" / "training.jsonl")
    resumed = testing.train_inprocess(config, "--checkpoint.checkpoint_dir", tmp_path / "resumed",
                                      "--restore_from.path", tmp_path / "ref" / "epoch_0_step_2", route=ROUTE)
    got = testing.losses_by_step(tmp_path / "resumed" / "training.jsonl")
    assert sorted(got) == [3, 4] and [got[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]
    for (name, a), b in zip(reference.model.state_dict().items(), resumed.model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def test_the_student_saves_as_a_sentence_transformers_model_with_its_projection_beside(tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from safetensors.torch import load_file

    from automodel_retrieval import BiEncoder

    config = write_config(tmp_path / "cfg.yaml", DISTILL, tmp_path / "ckpt", step_scheduler={"max_steps": 2},
                          retrieval={"query_prefix": "query: ", "document_prefix": "passage: "})
    recipe = testing.train_inprocess(config, route=ROUTE)
    model_dir = latest(tmp_path / "ckpt") / "model"
    texts = QUERIES
    collator = recipe.default_collate_fn(False)
    with torch.no_grad():
        ours = recipe.model.eval().encode("query", collator.encode_queries(texts))
    loaded = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
    theirs = loaded.encode_query(texts, convert_to_tensor=True)
    assert theirs.shape == (3, 64) and torch.allclose(theirs, ours, atol=1e-5), "the student's own embeddings"
    again = BiEncoder.from_pretrained(str(model_dir))
    assert type(again) is BiEncoder and again.input_setting("query_prefix") == "query: "
    saved = load_file(str(model_dir / "distill_projection" / "projection.safetensors"))
    assert torch.equal(saved["projection.weight"], recipe.model.projection.weight.detach())
    assert json.loads((model_dir / "distill_projection" / "config.json").read_text()) == \
        {"in_features": 64, "out_features": 48}


def test_no_projection_when_the_widths_match(tmp_path):
    teacher = {"_target_": "automodel_retrieval.BiEncoder.from_config", "config": str(BERT_CONFIG), "seed": 3}
    config = write_config(tmp_path / "cfg.yaml", {**DISTILL, "teacher_model": teacher}, tmp_path / "ckpt",
                          step_scheduler={"max_steps": 1})
    recipe = testing.train_inprocess(config, route=ROUTE)
    assert recipe.model.projection is None
    assert not (latest(tmp_path / "ckpt") / "model" / "distill_projection").exists()


@pytest.mark.parametrize("sections,key,needle", [
    ({"distill_loss_weight": 0.0}, "distill_loss_weight", "nothing would train"),
    ({"mse_loss_weight": -1}, "mse_loss_weight", "a number >= 0"),
    ({"loss_fn": {"temperature": 0.1}}, "loss_fn", "distill_loss, mse_loss and infonce_distill_loss"),
    ({"teacher_embeddings_cache": "cache/"}, "teacher_embeddings_cache", "the teacher embeds each batch"),
    ({"nce_loss_weight": 1.0}, "nce_loss_weight", "trains contrastively"),
    ({"infonce_distill_loss": {"divergence": "js"}}, "infonce_distill_loss.divergence", "'js' is not one of"),
    ({"infonce_distill_loss": {"temperature": 0}}, "infonce_distill_loss.temperature", "a number > 0"),
    ({"mse_loss": {"reduction": "none"}}, "mse_loss.reduction", "'none' is not one of"),
])
def test_values_that_cannot_act_are_refused(tmp_path, sections, key, needle):
    config = write_config(tmp_path / "cfg.yaml", DISTILL, tmp_path / "ckpt", **sections)
    with pytest.raises(ConfigError) as info:
        testing.load_config(config, route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert any(k.startswith(key) and needle in m for k, m in found.items()), found


# ---- upstream's form -------------------------------------------------------------------------------------------

UPSTREAM = Path(__file__).parent / "upstream_forms" / "distill_upstream.yaml"


@pytest.fixture(scope="module")
def upstream_inputs(tmp_path_factory):
    """A saved tiny BERT student (64 wide), a saved wider BERT teacher (96) and inline rows."""
    from transformers import AutoConfig, AutoModel

    root = tmp_path_factory.mktemp("upstream_distill")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(BERT_CONFIG))
    AutoModel.from_config(config).save_pretrained(str(root / "student"))
    config.hidden_size, config.intermediate_size = 96, 192
    AutoModel.from_config(config).save_pretrained(str(root / "teacher"))
    rows = testing.read_jsonl(DATA / "train.jsonl")[:32]
    inline = root / "train.jsonl"
    inline.write_text("".join(json.dumps({"question": r["query"], "pos_doc": [{"text": r["positive"]}],
                                          "neg_doc": r["negatives"][:2]}) + "\n" for r in rows))
    return root


def _upstream_overrides(root, checkpoint_dir):
    return ["--model.pretrained_model_name_or_path", root / "student", "--teacher_model.pretrained_model_name_or_path",
            root / "teacher", "--dataset.data_dir_list", f"[{root / 'train.jsonl'}]", "--checkpoint.checkpoint_dir",
            checkpoint_dir]


def test_upstream_form_validates_and_trains_three_steps_through_the_cli(upstream_inputs, tmp_path):
    result = testing.run_cli("run", "-c", UPSTREAM, *_upstream_overrides(upstream_inputs, tmp_path / "ckpt"),
                             cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [3]
    assert "projection 64 -> 96" in result.stderr
    assert "1.0 * distill_loss + 1.0 * mse_loss + 0.5 * infonce_distill_loss" in result.stderr
    model_dir = latest(tmp_path / "ckpt") / "model"
    settings = json.loads((model_dir / "bi_encoder_config.json").read_text())
    assert settings["shared"] and settings["normalize"] is False and settings["query_prefix"] == "query: "


def test_upstream_form_builds_upstreams_pieces(upstream_inputs, tmp_path):
    recipe = testing.train_inprocess(UPSTREAM, *_upstream_overrides(upstream_inputs, tmp_path), route=ROUTE,
                                     setup_only=True)
    model, loss = recipe.model, recipe.loss_fn
    assert model.shared and model.pooling == "mean" and not model.normalize, "avg, l2_normalize: false"
    assert model.projection.out_features == 96 and recipe.teacher.query_encoder.config.hidden_size == 96
    assert loss.weights == {"distill_loss": 1.0, "mse_loss": 1.0, "infonce_distill_loss": 0.5}
    assert loss.losses["infonce_distill_loss"].temperature == 0.05
    collator = recipe.dataloader.collate_fn.fn
    assert (collator.query_max_length, collator.document_max_length, collator.query_prefix) == (32, 48, "query: ")


@pytest.mark.parametrize("override,key,needle", [
    (("--model.capture_layers", "[1]"), "model.capture_layers", "intermediate-layer loss"),
    (("--teacher_model.capture_layers", "[1]"), "teacher_model.capture_layers", "intermediate-layer loss"),
    (("--model.teacher_hidden_size", "0"), "model.teacher_hidden_size", "integer >= 1"),
    (("--teacher_model.attn_implementation", "flash_attention_2"), "teacher_model.attn_implementation", "CUDA"),
    (("--dataloader.collate_fn.teacher_embeddings_cache", "cache/"), "dataloader.collate_fn.teacher_embeddings_cache",
     "the teacher embeds each batch"),
])
def test_upstream_values_that_cannot_act_are_refused(override, key, needle):
    with pytest.raises(ConfigError) as info:
        testing.load_config(UPSTREAM, "--model.pretrained_model_name_or_path", TOKENIZER_DIR, *override, route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert key in found and needle in found[key], found


def test_a_teacher_hidden_size_other_than_the_local_teachers_is_refused_at_validation(upstream_inputs, tmp_path):
    overrides = [*_upstream_overrides(upstream_inputs, tmp_path), "--model.teacher_hidden_size", "64"]
    with pytest.raises(ConfigError) as info:
        testing.load_config(UPSTREAM, *overrides, route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert "embeds 96 wide (its hidden_size); set 96" in found["model.teacher_hidden_size"], found
