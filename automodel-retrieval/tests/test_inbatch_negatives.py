"""Upstream's ``do_distributed_inbatch_negative`` / ``detach_distributed_inbatch_negatives`` on the bi-encoder.

With gradients through the gathered documents, 2 gloo ranks with batch B train as one process with batch 2B (the
gradient summed over ranks is the one process's gradient of the global contrastive loss: the loop divides every
rank's summed loss by the step's queries of all ranks, DDP / FSDP2 average). Detached, each rank's forward is the
same (so is the first loss) but its gradient leaves out what the other ranks' queries put on its documents.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from inbatch_workers import DOCUMENTS, TEMPERATURE, gather_worker, toy
from retrieval_testing import BERT_CONFIG, DATA, DIST_DIR, PKG_DIR, TOKENIZER_DIR

from automodel import testing
from automodel.errors import ConfigError
from automodel_retrieval import upstream
from automodel_retrieval.losses import InfoNCELoss
from automodel_retrieval.recipe import BiEncoderRecipe

FORMS = DIST_DIR / "tests" / "upstream_forms"
BI_FORM = FORMS / "bi_encoder_upstream.yaml"
STEPS = 4
GATHER = "--model.do_distributed_inbatch_negative"
DETACH = "--model.detach_distributed_inbatch_negatives"

# ---- the gather itself, on two gloo ranks: which gradient reaches each rank's documents -----------------------

def _reference() -> dict[str, list[torch.Tensor]]:
    """One process: each rank's loss against all documents, and the gradients of each loss and of their sum."""
    queries, documents = toy()
    everything = torch.cat(documents)
    losses = [InfoNCELoss(TEMPERATURE)(query, everything, torch.arange(len(query)) + sum(DOCUMENTS[:rank]))
              for rank, query in enumerate(queries)]
    own = [torch.autograd.grad(loss, [documents[rank]], retain_graph=True)[0] for rank, loss in enumerate(losses)]
    total = torch.autograd.grad(sum(losses), queries + documents)
    return {"losses": [loss.detach() for loss in losses], "query": list(total[:2]), "all": list(total[2:]),
            "own": own}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of two gloo ranks computed (inbatch_workers.gather_worker)."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("gather")
    mp.spawn(gather_worker, args=(f"file://{root}/rendezvous", str(root)), nprocs=2)
    return [torch.load(root / f"rank{rank}.pt") for rank in range(2)]


def test_the_gather_sends_each_rank_the_gradient_its_mode_promises(ranks):
    """With gradients: each rank's documents get the gradient of the sum of both ranks' losses. Detached: only
    that of their own rank's loss. The losses and the queries' gradients are the same either way."""
    reference = _reference()
    assert not torch.allclose(reference["own"][0], reference["all"][0]), "the two modes must differ here"
    for rank, found in enumerate(ranks):
        for detach, mode in ((False, found[False]), (True, found[True])):
            torch.testing.assert_close(mode["loss"], reference["losses"][rank])
            torch.testing.assert_close(mode["query"], reference["query"][rank])
            torch.testing.assert_close(mode["documents"], reference["own" if detach else "all"][rank])


def test_the_distillation_listwise_loss_ranks_every_ranks_documents(ranks):
    """The distillation recipe's cross_device_negatives: each rank's queries ranked against both ranks' documents
    (rank 1 has fewer: its padding is no candidate), as one process ranking them against all documents."""
    from inbatch_workers import teacher

    from automodel_retrieval.distill_losses import InfoNCEDistillLoss

    queries, documents = toy()
    teacher_queries, teacher_documents = teacher()
    everything, teacher_everything = torch.cat(documents), torch.cat(teacher_documents)
    for rank, found in enumerate(ranks):
        expected = InfoNCEDistillLoss(TEMPERATURE)(queries[rank], everything, teacher_queries[rank],
                                                   teacher_everything,
                                                   torch.arange(len(queries[rank])) + sum(DOCUMENTS[:rank]))
        torch.testing.assert_close(found["distill"]["loss"], expected.detach())
        torch.testing.assert_close(found["distill"]["query"], torch.autograd.grad(expected, queries[rank])[0])
    alone = InfoNCEDistillLoss(TEMPERATURE)(queries[0], documents[0], teacher_queries[0], teacher_documents[0])
    assert float(alone) != pytest.approx(float(ranks[0]["distill"]["loss"])), "the other rank's documents count"


# ---- validation, notes and the plan ---------------------------------------------------------------------------

def _form_config(*overrides, route=("finetune", "retrieval")):
    data = str(DATA / "train.jsonl")
    return testing.load_config(BI_FORM, "--model.pretrained_model_name_or_path", TOKENIZER_DIR,
                               "--dataset.data_dir_list", f"[{data}]", "--validation_dataset.data_dir_list",
                               f"[{data}]", *overrides, route=route)[1]


@pytest.mark.parametrize("settings,mode", [({}, "local"), ({"do_distributed_inbatch_negative": False}, "local"),
                                           ({"do_distributed_inbatch_negative": True}, "detached"),
                                           ({"do_distributed_inbatch_negative": True,
                                             "detach_distributed_inbatch_negatives": False}, "gathered")])
def test_upstreams_keys_choose_the_negatives_as_upstream_with_its_defaults(settings, mode):
    assert upstream.inbatch_negatives(settings) == mode


def test_the_recipe_reads_the_mode_from_upstreams_model_and_gathers_with_gradients_otherwise():
    form = _form_config(GATHER, "true", DETACH, "false")
    assert BiEncoderRecipe.inbatch_negatives(form) == "gathered"
    assert BiEncoderRecipe.inbatch_negatives(_form_config()) == "local", "the form gives false"
    native = testing.load_config(PKG_DIR / "examples" / "tiny_bi_encoder.yaml", route=("finetune", "retrieval"))
    assert BiEncoderRecipe.inbatch_negatives(native[1]) == "gathered"


def test_the_dry_run_plan_names_the_negatives(tmp_path):
    (tmp_path / "rows.jsonl").write_text((DATA / "train.jsonl").read_text())
    common = ["finetune", "retrieval", "-c", BI_FORM, "--model.pretrained_model_name_or_path", TOKENIZER_DIR,
              "--dataset.data_dir_list", "[rows.jsonl]", "--validation_dataset.data_dir_list", "[rows.jsonl]",
              "--step_scheduler.local_batch_size", 4, "--dry-run"]
    for launch, overrides, line in (
            ([], [GATHER, "true"], "in-batch negatives: the micro-batch's documents (one process)"),
            (["--nproc-per-node", 2], [], "in-batch negatives: each rank's own micro-batch"),
            (["--nproc-per-node", 2], [GATHER, "true"], "in-batch negatives: every rank's documents, the other "
                                                        "ranks' without gradients")):
        result = testing.run_cli_inprocess(*common, *launch, *overrides, cwd=tmp_path)
        assert result.returncode == 0 and line in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("value", ["sometimes", 3])
def test_values_other_than_true_or_false_are_refused(value):
    with pytest.raises(ConfigError) as info:
        _form_config(DETACH, value)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert "expected true or false" in found["model.detach_distributed_inbatch_negatives"], found


def test_the_cross_encoder_refuses_them():
    cross = FORMS / "cross_encoder_upstream.yaml"
    with pytest.raises(ConfigError, match="does not accept an argument 'do_distributed_inbatch_negative'"):
        testing.load_config(cross, "--model.pretrained_model_name_or_path", TOKENIZER_DIR, GATHER, "true",
                            route=("finetune", "cross-encoder"))


def test_notes_name_the_keys_that_govern_nothing():
    one = upstream.inbatch_negatives_notes({"do_distributed_inbatch_negative": True}, 1)
    assert one == ["note: model.do_distributed_inbatch_negative: true governs nothing this run: gathering the other "
                   "ranks' documents as negatives needs more than one process, and this run is one"]
    both = upstream.inbatch_negatives_notes({"do_distributed_inbatch_negative": True,
                                             "detach_distributed_inbatch_negatives": False}, 1)
    assert "do_distributed_inbatch_negative: true and model.detach_distributed_inbatch_negatives: false govern" \
        in both[0]
    alone = upstream.inbatch_negatives_notes({"detach_distributed_inbatch_negatives": True}, 2)
    assert "applies with model.do_distributed_inbatch_negative: true" in alone[0]
    assert upstream.inbatch_negatives_notes({"do_distributed_inbatch_negative": True}, 2) == []


# ---- whole runs: one process with batch 8 against two ranks with batch 4 each -----------------------------------

@pytest.fixture(scope="module")
def form(tmp_path_factory):
    """Upstream's bi-encoder form with gathered negatives, on a saved tiny BERT without dropout (so that one process
    and two ranks compute the same thing), inline rows in order, no validation."""
    from transformers import AutoConfig, AutoModel

    root = tmp_path_factory.mktemp("inbatch")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(BERT_CONFIG), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    AutoModel.from_config(config).save_pretrained(str(root / "encoder"))
    rows = testing.read_jsonl(DATA / "train.jsonl")[:32]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"question": r["query"], "pos_doc": r["positive"], "neg_doc": r["negatives"]})
                            + "\n" for r in rows))
    settings = yaml.safe_load(BI_FORM.read_text())
    settings.pop("validation_dataset")
    settings["model"].update(pretrained_model_name_or_path=str(root / "encoder"), do_distributed_inbatch_negative=True)
    settings["dataset"]["data_dir_list"] = [str(data)]
    settings["step_scheduler"].update(max_steps=STEPS, ckpt_every_steps=STEPS, val_every_steps=100, log_interval=1)
    settings["dataloader"]["shuffle"] = False
    return testing.write_yaml(root / "form.yaml", settings)


def _run(form, out, *overrides, ranks: int = 1):
    launch = ["--nproc-per-node", ranks, "--master-port", testing.free_port(),
              "--step_scheduler.local_batch_size", 4] if ranks > 1 else []
    result = testing.run_cli("finetune", "retrieval", "-c", form, "--checkpoint.checkpoint_dir", out, *launch,
                             *overrides, cwd=out.parent, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    records = testing.read_jsonl(out / "training.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return records, result.stderr


def _weights(out) -> dict[str, torch.Tensor]:
    return testing.load_safetensors_state(out / (out / "LATEST").read_text().strip() / "model")


@pytest.fixture(scope="module")
def one_process(form, tmp_path_factory):
    """The reference: one process, batch 8 (its note: the keys govern nothing in one process)."""
    out = tmp_path_factory.mktemp("one") / "ckpt"
    records, stderr = _run(form, out, DETACH, "false")
    assert "note: model.do_distributed_inbatch_negative: true and model.detach_distributed_inbatch_negatives: " \
           "false govern nothing this run" in stderr
    return records, _weights(out)


def test_two_ranks_with_gathered_negatives_train_as_one_process_with_twice_the_batch(form, one_process, tmp_path):
    records, stderr = _run(form, tmp_path / "ckpt", DETACH, "false", ranks=2)
    assert "in-batch negatives: every rank's documents, gathered with their gradients" in stderr
    reference, weights = one_process
    for name in ("loss", "grad_norm"):
        assert [r[name] for r in records] == pytest.approx([r[name] for r in reference], rel=1e-5), name
    found = _weights(tmp_path / "ckpt")
    assert found.keys() == weights.keys()
    # Within 1e-5, a hundredth of one step's update (lr 2e-3): AdamW divides each gradient by its own running size,
    # so an entry whose true gradient is (nearly) 0 moves by normalised float noise that the two runs' summation
    # orders make differ, by a few 1e-6 after four steps (attention's key bias, which softmax ignores, on every CPU;
    # single entries of other weights on some CPUs' kernels).
    differ = {key: float((found[key] - value).abs().max()) for key, value in weights.items()
              if not torch.allclose(found[key], value, rtol=1e-5, atol=1e-5)}
    assert not differ, differ


def test_detached_negatives_keep_the_first_loss_and_change_the_updates(form, one_process, tmp_path):
    """Upstream's default once gathering is on: the same forward, so the same first loss; a gradient without the
    other rank's queries' pull on this rank's documents, so another gradient norm and other losses after it."""
    records, stderr = _run(form, tmp_path / "ckpt", ranks=2)
    assert "in-batch negatives: every rank's documents, the other ranks' without gradients" in stderr
    reference, _ = one_process
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert records[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-5)
    assert records[0]["grad_norm"] != pytest.approx(reference[0]["grad_norm"], rel=1e-3)
    assert records[-1]["loss"] != pytest.approx(reference[-1]["loss"], rel=1e-3)
