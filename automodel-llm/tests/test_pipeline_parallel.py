"""Pipeline parallelism through the CLI on CPU ranks (gloo): ``distributed.pp_size: 2`` on two ranks splits a tiny
2-layer Llama into two stages (GPipe and 1F1B) and trains with the per-step losses, gradient norms and validation
losses of one process, two micro-batches of different lengths accumulated per step; its consolidated ``model/`` is
the one process's weights; a pp=2 checkpoint resumes in one process (from model/) and on pp=2 (from the sharded
model_shards/) with the uninterrupted run's losses; layouts and settings the pipeline cannot take are refused by
``automodel validate`` with the numbers. A 4-layer Llama on pp=2 with the interleaved 1F1B schedule (two stages per
rank) trains like one process too, and its sharded checkpoint resumes in one process. A Llama that ties its head to
its embedding, trained or frozen, trains on pp=2 like one process (the last stage's head a copy of the first stage's
embedding, their gradients summed where it trains).

The ranks of one pipeline read the same rows, so the reference is one process with the same accumulation; with
pp=2 x dp=2 on four ranks, one process accumulating twice as many micro-batches; pp=2 x tp=2 on four ranks (each
stage tensor-parallel) trains like one process too. Gradient clipping (max_norm 1.0) acts on the norm over both
stages. The defaults that cannot act through the pipeline (``logits.label_positions_only``,
``distributed.defer_fsdp_grad_sync``) are named in a note at the start of a run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llm_testing import (
    SIX_STEPS,
    VALIDATION,
    assert_like_reference,
    assert_same_weights,
    fsdp2_ranks_with,
    grad_norms,
    losses,
    run_finetune,
    val_losses,
    validate_cli,
    write_config,
    write_two_layer_llama_config,
)

from automodel.testing import read_jsonl, run_cli, run_cli_inprocess

STEPS = [*SIX_STEPS, "--step_scheduler.grad_accumulation_steps", "2"]
PP2 = fsdp2_ranks_with("pp_size")


@pytest.fixture(scope="module")
def pp_llama_config(tmp_path_factory) -> Path:
    """A 2-layer Llama with its own output head (pipeline stages cannot tie it to the embedding)."""
    return write_two_layer_llama_config(tmp_path_factory.mktemp("pp_llama"))


def _run(config: Path, cwd: Path, directory: Path, *args) -> str:
    return run_finetune(config, cwd, directory, *STEPS, *args)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, pp_llama_config) -> tuple[Path, Path]:
    """(config, checkpoint_dir) of the one-process reference: six steps, checkpoints after steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("one")
    config = write_config(tmp / "cfg.yaml", pp_llama_config, tmp / "ckpt", validation_dataset=VALIDATION,
                          step_scheduler={"val_check_interval": 3})
    _run(config, tmp, tmp / "ckpt")
    return config, tmp / "ckpt"


@pytest.fixture(scope="module")
def pp2_1f1b(tmp_path_factory, one_process) -> tuple[Path, str]:
    """(checkpoint_dir, log) of the 1F1B run (its step-3 checkpoint, with model/, is resumed in one process)."""
    tmp = tmp_path_factory.mktemp("pp2")
    return tmp / "pp", _run(one_process[0], tmp, tmp / "pp", *PP2, "--distributed.pipeline.pp_schedule", "1f1b")


@pytest.fixture(scope="module")
def pp2_gpipe(tmp_path_factory, one_process) -> tuple[Path, str]:
    """(checkpoint_dir, log) of the GPipe run; its step-3 checkpoint holds the sharded form only (model_shards/)."""
    tmp = tmp_path_factory.mktemp("pp2_gpipe")
    return tmp / "pp", _run(one_process[0], tmp, tmp / "pp", *PP2, "--distributed.pipeline.pp_schedule", "gpipe",
                            "--checkpoint.save_consolidated", "final")


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_pp2_trains_like_one_process(request, one_process, schedule):
    reference = one_process[1]
    out, log = request.getfixturevalue(f"pp2_{schedule}")
    assert "pipeline stage 0 of 2 on this rank (embedding + layers 0-0)" in log
    assert f"{schedule} schedule" in log and "FSDP2 over 1 ranks" in log
    # the defaults that cannot act through torch's pipeline stages are named at the start
    assert "note: logits.label_positions_only: true governs nothing this run" in log
    assert "defer_fsdp_grad_sync" not in log  # it acts: FSDP2 reduces after the step's second batch only
    assert max(grad_norms(reference)) > 1.0 and len(val_losses(out)) == 2  # clipping acted; validation ran twice
    assert_like_reference(out, reference)


@pytest.mark.slow
def test_packed_rows_keep_attention_within_each_sample_through_the_stages(one_process, tmp_path):
    """Packed rows (several samples a row, position ids restarting at each) through two stages: each stage's
    attention stays within the samples as in one process (attention across them would change every loss). The
    pipelined run uses FusedLinearCrossEntropy (chunk_len 7): its last stage returns the final hidden states, the
    schedule's loss projects them through the head, and losses, gradient norms and the validation loss are those of
    MaskedCrossEntropy in one process."""
    config = one_process[0]
    packing = ["--packed_sequence.packed_sequence_size", "96", "--step_scheduler.max_steps", "3",
               "--step_scheduler.checkpoint_interval", "3"]
    reference, out = tmp_path / "one", tmp_path / "pp"
    _run(config, tmp_path, reference, *packing)
    log = _run(config, tmp_path, out, *PP2, *packing, "--loss_fn._target_", "FusedLinearCrossEntropy",
               "--loss_fn.chunk_len", "7")
    # upstream's default pp_seq_len: the packed rows' length; the last stage sends no logits
    assert "pipeline stage shapes: static (pp_seq_len 96)" in log and "the loss applies the output head" in log
    assert losses(out) == pytest.approx(losses(reference), rel=1e-4)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), rel=1e-4)
    assert [v for _, v in val_losses(out)] == pytest.approx([v for _, v in val_losses(reference)], rel=1e-5)
    assert losses(out) != pytest.approx(losses(one_process[1])[:3], rel=1e-3)  # packing changed the rows


@pytest.mark.slow  # make test-slow: the interleaved test below resumes a two-rank pipeline's checkpoint in one process
def test_a_pp2_checkpoint_resumes_in_one_process(one_process, pp2_1f1b, tmp_path):
    config, reference = one_process
    checkpoint, one = pp2_1f1b[0] / "epoch_0_step_3", tmp_path / "one"
    log = _run(config, tmp_path, one, "--restore_from.path", checkpoint)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert (state["world_size"], state["dp_size"]) == (2, 1) and "written by 2 ranks, resuming on 1" in log
    assert [row["step"] for row in read_jsonl(one / "training.jsonl")] == [4, 5, 6]
    assert losses(one) == pytest.approx(losses(reference)[3:], rel=1e-4)
    assert_same_weights(one / "epoch_0_step_6" / "model", reference / "epoch_0_step_6" / "model")


def test_a_sharded_pp2_checkpoint_resumes_on_pp2(pp2_gpipe, one_process, tmp_path):
    """The same layout, another schedule: each stage reads its own tensors of model_shards/ (DCP)."""
    checkpoint, again = pp2_gpipe[0] / "epoch_0_step_3", tmp_path / "again"
    assert (checkpoint / "model_shards").is_dir() and not (checkpoint / "model").exists()
    log = _run(one_process[0], tmp_path, again, *PP2, "--restore_from.path", checkpoint)
    assert "resuming on" not in log and "1f1b schedule" in log
    assert losses(again) == pytest.approx(losses(pp2_gpipe[0])[3:], rel=1e-5)


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_pp2_x_dp2_on_four_ranks_trains_like_one_process_accumulating_twice(one_process, tmp_path):
    """FSDP2 shards each stage over two data-parallel ranks, which feed their pipelines different rows (three steps)."""
    config, steps = one_process[0], ["--step_scheduler.max_steps", "3", "--step_scheduler.checkpoint_interval", "3"]
    reference, out = tmp_path / "accumulating", tmp_path / "pp2_dp2"
    _run(config, tmp_path, reference, *steps, "--step_scheduler.grad_accumulation_steps", "4")
    log = _run(config, tmp_path, out, *steps, "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
               "--distributed.pp_size", "2")
    assert "FSDP2 over 2 ranks" in log
    assert_like_reference(out, reference, steps=3)


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_pp2_x_tp2_on_four_ranks_trains_like_one_process(one_process, tmp_path):
    """Each stage tensor-parallel over two ranks, which read the same rows (three steps: 1e-4 relative)."""
    config, steps = one_process[0], ["--step_scheduler.max_steps", "3", "--step_scheduler.checkpoint_interval", "3"]
    out = tmp_path / "pp2_tp2"
    log = _run(config, tmp_path, out, *steps, "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
               "--distributed.pp_size", "2", "--distributed.tp_size", "2")
    reference = one_process[1]
    assert "FSDP2 over 1 ranks" in log
    assert losses(out) == pytest.approx(losses(reference)[:3], rel=1e-4)
    assert grad_norms(out) == pytest.approx(grad_norms(reference)[:3], rel=1e-4)
    assert [v for _, v in val_losses(out)] == pytest.approx([v for _, v in val_losses(reference)[:1]], rel=1e-4)
    assert_same_weights(out / "epoch_0_step_3" / "model", reference / "epoch_0_step_3" / "model")


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_pp_seq_len_with_tensor_parallel_stages_trains_like_one_process(one_process, tmp_path):
    """pp=2 x tp=2 with static stage shapes (the stages return plain tensors, whole on each tensor-parallel rank):
    the losses and gradient norms of one process (three steps: 1e-4 relative)."""
    config, steps = one_process[0], ["--step_scheduler.max_steps", "3", "--step_scheduler.checkpoint_interval", "3"]
    out = tmp_path / "pp2_tp2_static"
    log = _run(config, tmp_path, out, *steps, "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
               "--distributed.pp_size", "2", "--distributed.tp_size", "2", "--distributed.pipeline.pp_seq_len", "128",
               "--distributed.pipeline.dtype", "fp32")
    assert "pipeline stage shapes: static (pp_seq_len 128)" in log
    reference = one_process[1]
    assert losses(out) == pytest.approx(losses(reference)[:3], rel=1e-4)
    assert grad_norms(out) == pytest.approx(grad_norms(reference)[:3], rel=1e-4)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> tuple[Path, Path]:
    """(config, checkpoint_dir) of the one-process reference with a 4-layer Llama (two stages on each of two ranks
    with an interleaved schedule)."""
    tmp = tmp_path_factory.mktemp("four")
    model = write_two_layer_llama_config(tmp)
    model.write_text(json.dumps({**json.loads(model.read_text()), "num_hidden_layers": 4}))
    config = write_config(tmp / "cfg.yaml", model, tmp / "ckpt", validation_dataset=VALIDATION,
                          step_scheduler={"val_check_interval": 3})
    _run(config, tmp, tmp / "ckpt")
    return config, tmp / "ckpt"


def test_interleaved_1f1b_runs_two_stages_per_rank_like_one_process(four_layers, tmp_path):
    """Stages 0 and 2 on one rank, 1 and 3 on the other; the last checkpoint's model/ is exported from every
    stage's shards; the sharded step-3 checkpoint (model_shards/ and the optimizer's, keyed by the model's names)
    resumes in one process with the uninterrupted run's losses."""
    config, reference = four_layers
    out, one = tmp_path / "pp", tmp_path / "one"
    log = _run(config, tmp_path, out, *PP2, "--distributed.pipeline.pp_schedule", "interleaved1f1b",
               "--checkpoint.save_consolidated", "final")
    assert "pipeline stages 0 (embedding + layers 0-0), 2 (layers 2-2) of 4 on this rank" in log
    assert "interleaved1f1b schedule" in log
    assert_like_reference(out, reference)
    assert not (out / "epoch_0_step_3" / "model").exists()
    log = _run(config, tmp_path, one, "--restore_from.path", out / "epoch_0_step_3")
    assert "written by 2 ranks, resuming on 1" in log
    assert losses(one) == pytest.approx(losses(reference)[3:], rel=1e-4)
    assert_same_weights(one / "epoch_0_step_6" / "model", reference / "epoch_0_step_6" / "model")


# the frozen pair in make test-slow: the default suite has it frozen by LoRA (test_pipeline_parallel_lora.py)
@pytest.fixture(scope="module", params=["trained", pytest.param("frozen", marks=pytest.mark.slow)])
def tied_runs(request, tmp_path_factory) -> dict[str, Path | str]:
    """One process and pp=2 (GPipe) training a Llama whose head is tied to its embedding, which trains or is frozen
    (``freeze.embeddings``): six steps, checkpoints after steps 3 and 6."""
    tmp = tmp_path_factory.mktemp(f"tied_{request.param}")
    config = write_config(tmp / "cfg.yaml", write_two_layer_llama_config(tmp, tied=True), tmp / "ckpt",
                          validation_dataset=VALIDATION, freeze={"embeddings": request.param == "frozen"},
                          step_scheduler={"val_check_interval": 3})
    run_finetune(config, tmp, tmp / "one", *STEPS)
    log = run_finetune(config, tmp, tmp / "pp", *STEPS, *PP2, "--distributed.pipeline.pp_schedule", "gpipe")
    return {"config": config, "one": tmp / "one", "pp": tmp / "pp", "log": log, "how": request.param}


def test_a_tied_head_trains_on_pp2_like_one_process(tied_runs):
    """A model that ties its head to its embedding: the last stage's head is a copy of the first stage's embedding
    (a fresh one here); trained, the two copies' gradients are summed at each step (the tied weight's gradient in one
    process) and counted once in the clipped norm; frozen (``freeze.embeddings``, which acts on the first stage),
    they stay as they are. Either way the run has one process's losses, gradient norms and validation losses; its
    model/ says untied, with the head equal to the embedding, and holds the one process's weights."""
    log, how = tied_runs["log"], tied_runs["how"]
    kept = "both train, their gradients summed at each step" if how == "trained" else "both frozen"
    assert f"is the first stage's embedding, sent to the last stage ({kept})" in log
    assert ("freeze [patterns]: froze 1 of" in log) is (how == "frozen")  # the first stage's embedding
    assert_like_reference(tied_runs["pp"], tied_runs["one"])
    saved = tied_runs["pp"] / "epoch_0_step_6" / "model"
    assert json.loads((saved / "config.json").read_text())["tie_word_embeddings"] is False
    from safetensors.torch import load_file

    weights = load_file(saved / "model.safetensors")
    assert (weights["lm_head.weight"] == weights["model.embed_tokens.weight"]).all()


@pytest.mark.slow  # make test-slow: the checkpoints of the test above, resumed on the other layout
def test_tied_checkpoints_resume_across_one_process_and_pp2(tied_runs, tmp_path):
    """One process's step-3 checkpoint (the weight saved once, tied) resumes on pp=2: the last stage's head copy
    reads the embedding's values and optimizer state; pp=2's (an untied head copy saved beside the embedding)
    resumes in one process, the copy read once. Both continue with the uninterrupted run's losses."""
    config, one, pp = tied_runs["config"], tied_runs["one"], tied_runs["pp"]
    run_finetune(config, tmp_path, tmp_path / "to_pp", *STEPS, *PP2, "--restore_from.path", one / "epoch_0_step_3")
    run_finetune(config, tmp_path, tmp_path / "to_one", *STEPS, "--restore_from.path", pp / "epoch_0_step_3")
    for resumed in ("to_pp", "to_one"):
        assert losses(tmp_path / resumed) == pytest.approx(losses(one)[3:], rel=1e-4), resumed


@pytest.mark.slow  # make test-slow: the copy between differently sharded stages is core's four-rank test's
def test_a_tied_head_on_pp2_x_tp2_trains_like_one_process(tied_runs, tmp_path):
    """Each stage tensor-parallel over two ranks: every tensor-parallel rank of the last stage gets its part of
    the first stage's embedding (and, trained, sums its shard of the gradients with its partner's)."""
    out = tmp_path / "pp_tp"
    run_finetune(tied_runs["config"], tmp_path, out, *STEPS, *PP2, "--nproc-per-node", "4",
                 "--distributed.tp_size", "2")
    assert_like_reference(out, tied_runs["one"])


def test_layouts_the_pipeline_cannot_take_are_refused_byvalidate_cli(pp_llama_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", pp_llama_config, tmp_path / "ckpt",
                          distributed={"strategy": "fsdp2", "pp_size": 3}, dataloader={"batch_size": 4})
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "3", subprocess=True)
    assert code == 2 and "Traceback" not in out
    assert "distributed.pp_size: 3 ranks x 1 stages each = 3 stages, but the model has 2 layers" in out
    two = ["--nproc-per-node", "2", "--distributed.pp_size", "2"]
    code, out = validate_cli(config, tmp_path, *two, "--dataloader.batch_size", "1")
    assert code == 2 and "1 makes 1 micro-batches of the 1 rows, but 1f1b needs at least one per stage (2)" in out
    code, out = validate_cli(config, tmp_path, *two, "--distributed.strategy", "ddp", "--model.tie_word_embeddings",
                          "true", "--distributed.pipeline.pp_schedule", "gpipe")
    assert code == 2 and "Traceback" not in out
    assert "distributed.strategy: ddp: pipeline parallelism (pp_size 2) composes with FSDP2" in out
    assert "tie_word_embeddings" not in out  # a tied head runs pipelined (test_a_tied_head_trains_on_pp2_...)
    code, out = validate_cli(config, tmp_path, *two, "--distributed.pipeline.pp_microbatch_size", "3")
    assert code == 2 and "pp_microbatch_size: 3 does not divide the 4 rows" in out


# make test-slow: the static stages train like one process in the core's pipeline scenarios
# (test_static_stage_shapes_skip_the_shape_finding_pass_and_train_like_one_process); the keys' checks stay below
@pytest.mark.slow
def test_pp_seq_len_builds_static_stage_shapes_and_trains_like_one_process(one_process, tmp_path):
    """``distributed.pipeline.pp_seq_len`` (with ``dtype``): every batch padded to 128 tokens, the stages built with
    static shapes (no shape-finding pass), the losses and gradient norms of one process (three steps); a batch
    longer than pp_seq_len stops the run with the key and the length."""
    config, steps = one_process[0], ["--step_scheduler.max_steps", "3", "--step_scheduler.checkpoint_interval", "3"]
    out = tmp_path / "static"
    log = _run(config, tmp_path, out, *steps, *PP2, "--distributed.pipeline.pp_seq_len", "128",
               "--distributed.pipeline.dtype", "fp32")
    assert "pipeline stage shapes: static (pp_seq_len 128): token ids [1, 128], hidden states [1, 128, 32] fp32" \
        in log and "no shape-finding pass on the first batch" in log
    reference = one_process[1]
    assert losses(out) == pytest.approx(losses(reference)[:3], rel=1e-4)
    assert grad_norms(out) == pytest.approx(grad_norms(reference)[:3], rel=1e-4)
    short = run_cli("finetune", "llm", "-c", config, *steps, *PP2, "--distributed.pipeline.pp_seq_len", "8",
                    "--checkpoint.checkpoint_dir", tmp_path / "short", cwd=tmp_path, OMP_NUM_THREADS="1")
    assert short.returncode != 0
    assert "distributed.pipeline.pp_seq_len: 8, but this step's batches are 64 tokens long (padded)" in short.stderr


def test_static_shape_settings_are_checked_byvalidate_cli(pp_llama_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", pp_llama_config, tmp_path / "ckpt",
                          distributed={"strategy": "fsdp2", "pp_size": 2}, dataloader={"batch_size": 4})
    two, key = ["--nproc-per-node", "2"], "distributed.pipeline"
    for args, words in [
        (["--distributed.pipeline.pp_seq_len", "0"], f"{key}.pp_seq_len: must be a positive integer"),
        (["--distributed.pipeline.pp_seq_len", "64", "--distributed.pipeline.dtype", "int8"],
         f"{key}.dtype: 'int8' is not a training dtype"),
        (["--distributed.pipeline.dtype", "bf16", "--distributed.mp_policy.param_dtype", "fp32"],
         f"{key}.dtype: bf16, but the stages exchange fp32"),  # without pp_seq_len too: each batch's length
        (["--distributed.pipeline.pp_seq_len", "64", "--distributed.pipeline.dtype", "fp32",
          "--distributed.mp_policy.param_dtype", "bf16"], f"{key}.dtype: fp32, but the stages exchange bf16"),
        (["--nproc-per-node", "4", "--distributed.tp_size", "2", "--distributed.sequence_parallel", "true",
          "--distributed.pipeline.pp_seq_len", "64"],
         f"{key}.pp_seq_len: 64 with sequence_parallel with tp_size 2: the stages exchange sequence-sharded"),
    ]:
        code, out = validate_cli(config, tmp_path, *two, *args)
        assert code == 2 and words in out, out
    code, out = validate_cli(config, tmp_path, *two, "--distributed.pipeline.pp_seq_len", "64",
                             "--distributed.pipeline.dtype", "bf16", "--distributed.mp_policy.param_dtype", "bf16")
    assert code == 0, out
    packed = ["--packed_sequence.packed_sequence_size", "128"]  # upstream's default pp_seq_len, dtype acts with it
    code, out = validate_cli(config, tmp_path, *two, *packed, "--distributed.pipeline.dtype", "fp32")
    assert code == 0, out
    four_tp = ["--nproc-per-node", "4", "--distributed.tp_size", "2", "--distributed.pipeline.dtype", "fp32"]
    code, out = validate_cli(config, tmp_path, *packed, *four_tp)
    assert code == 0, out  # inferred with tensor-parallel stages too
    code, out = validate_cli(config, tmp_path, *packed, *four_tp, "--distributed.sequence_parallel", "true")
    assert code == 2 and f"{key}.dtype: 'fp32' with sequence_parallel with tp_size 2" in out  # sequence shards
    four_cp = ["--nproc-per-node", "4", "--distributed.cp_size", "2"]  # each rank's part: 64 of 128 positions
    code, out = validate_cli(config, tmp_path, *four_cp, "--distributed.pipeline.pp_seq_len", "128",
                             "--distributed.pipeline.dtype", "fp32")
    assert code == 0, out
    code, out = validate_cli(config, tmp_path, *four_cp, "--distributed.pipeline.pp_seq_len", "66")
    assert code == 2 and f"{key}.pp_seq_len: 66 with cp_size 2: context parallelism splits each sequence into 4 " \
        "chunks, which 66 tokens do not divide into; use a multiple of 4" in out


def test_settings_the_pipeline_cannot_take_are_refused_byvalidate_cli(pp_llama_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", pp_llama_config, tmp_path / "ckpt",
                          distributed={"strategy": "fsdp2", "pp_size": 2}, dataloader={"batch_size": 4})
    two = ["--nproc-per-node", "2"]
    code, out = validate_cli(config, tmp_path, *two, "--distributed.pipeline.pp_schedule", "interleaved1f1b",
                          subprocess=True)
    assert code == 2 and "distributed.pp_size: 2 ranks x 2 stages each = 4 stages, but the model has 2 layers" in out
    code, out = validate_cli(config, tmp_path, *two, "--eval_generation.enabled", "true",
                          "--packed_sequence.packed_sequence_size", "64", "--peft.dim", "4",
                          "--distributed.mp_policy.param_dtype", "fp16", "--model.backend.enable_fsdp_optimizations",
                          "true")
    assert code == 2
    assert "enable_fsdp_optimizations" not in out  # acts with pipeline stages too (test_expert_parallel.py)
    assert "distributed.mp_policy.param_dtype: fp16 needs loss scaling" in out
    assert "eval_generation.enabled: generation runs the whole model token by token" in out
    assert "packed_sequence" not in out  # packed rows run pipelined (test_packed_rows_keep_...)
    code, out = validate_cli(config, tmp_path, *two, "--packed_sequence.packed_sequence_size", "256",
                             "--distributed.pipeline.pp_seq_len", "128")
    assert code == 2 and "distributed.pipeline.pp_seq_len: 128 is shorter than the packed rows" in out
    assert "peft" not in out  # LoRA runs pipelined (test_pipeline_parallel_lora.py)
    code, out = validate_cli(config, tmp_path, *two)
    assert code == 0, out
    result = run_cli_inprocess("validate", "kd", "llm", "-c", config, *two,
                               "--teacher_model._target_", "automodel_llm.AutoModelForCausalLM.from_config",
                               "--teacher_model.config", str(pp_llama_config), cwd=tmp_path)
    assert result.returncode == 2 and "the teacher runs beside the student on whole batches" in result.stderr


def test_dry_run_prints_the_stages_per_rank(pp_llama_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", pp_llama_config, tmp_path / "ckpt",
                          distributed={"strategy": "fsdp2", "pp_size": 2, "pipeline": {"pp_schedule": "gpipe",
                                                                                       "pp_microbatch_size": 2}})
    result = run_cli("finetune", "llm", "-c", config, "--nproc-per-node", "4", "--dry-run", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "device mesh: pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 1 = 4 ranks" in out
    assert "rank 3: pp 1, dp_replicate 0, dp_shard 1, cp 0, tp 0 (dp 1)" in out
    assert "pipeline parallel over pp 2: gpipe schedule, 2 stages, 2 micro-batches of 2 rows per batch" in out
    assert "pp rank 0: stage 0 (embedding + layers 0-0)" in out
    assert "pp rank 1: stage 1 (layers 1-1 + norm, head)" in out
