"""Tensor parallelism through the CLI on CPU ranks (gloo): ``distributed.tp_size: 2`` on two ranks (with and without
sequence parallelism) trains a tiny Llama with the per-step losses, gradient norms and validation losses of one
process, its consolidated ``model/`` is the one process's weights, a tp=2 checkpoint resumes in one process with the
uninterrupted run's losses; dp=2 x tp=2 on four ranks equals one process accumulating twice and its checkpoint
resumes under FSDP2 on two ranks; layouts the model cannot take are refused by ``automodel validate``.

The ranks of one tensor-parallel group read the same rows, so against one process only the data-parallel size
changes the accumulation. Gradient clipping (max_norm 1.0) acts on the parallel-aware norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llm_testing import (
    SIX_STEPS,
    VALIDATION,
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

TP2 = fsdp2_ranks_with("tp_size")


@pytest.fixture(scope="module")
def tp_llama_config(tmp_path_factory) -> Path:
    """A 2-layer Llama with 4 attention heads over 2 key/value heads (tp=2 divides every size), the shipped
    tokenizer's vocabulary (482, even)."""
    return write_two_layer_llama_config(tmp_path_factory.mktemp("tp_llama"))


def _run(config: Path, cwd: Path, directory: Path, *args) -> str:
    return run_finetune(config, cwd, directory, *SIX_STEPS, *args)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tp_llama_config) -> tuple[Path, Path]:
    """(config, checkpoint_dir) of the one-process reference: six steps, checkpoints after steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("one")
    config = write_config(tmp / "cfg.yaml", tp_llama_config, tmp / "ckpt", validation_dataset=VALIDATION,
                          step_scheduler={"val_check_interval": 3}, eval_generation={"enabled": True})
    _run(config, tmp, tmp / "ckpt")
    return config, tmp / "ckpt"


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, one_process) -> tuple[Path, str]:
    """(checkpoint_dir, log) of the tp=2 run without sequence parallelism (its step-3 checkpoint is resumed), its
    shards in host memory (FSDP2's CPU offload, which changes no number)."""
    tmp = tmp_path_factory.mktemp("tp2")
    return tmp / "tp", _run(one_process[0], tmp, tmp / "tp", *TP2, "--distributed.offload_policy.pin_memory", "false")


# each transformer block compiled (upstream's enable_compile; aot_eager: dynamo and autograd's tracing without
# inductor's code generation): the first block's input is the vocabulary-parallel embedding's output
COMPILED_BLOCKS = ["--distributed.enable_compile", "true", "--compile.backend", "aot_eager"]


@pytest.mark.parametrize("extra", [
    pytest.param([], id="tp2"),
    # make test-slow: sequence parallelism runs in the compiled-blocks case too (and with LoRA, tensor_parallel_lora)
    pytest.param(["--distributed.sequence_parallel", "true"], id="tp2_sequence_parallel", marks=pytest.mark.slow),
    pytest.param(["--distributed.sequence_parallel", "true", *COMPILED_BLOCKS],
                 id="tp2_sequence_parallel_compiled_blocks"),
])
def test_tp2_trains_like_one_process(request, one_process, tmp_path, extra):
    config, reference = one_process
    sequence_parallel = bool(extra)
    if extra:
        out = tmp_path / "tp"
        log = _run(config, tmp_path, out, *TP2, *extra, "--eval_generation.enabled", "false")
    else:
        out, log = request.getfixturevalue("tp2_run")
    assert "tensor parallel over tp 2" in log and "FSDP2 over 1 ranks x tensor parallel over 2" in log
    assert ("shards offloaded to host memory" in log) == (not extra)
    assert ("sequence parallel" in log) == sequence_parallel
    assert ("torch.compile of each of 2 transformer blocks" in log) == (COMPILED_BLOCKS[0] in extra)
    assert "model.layers.*.self_attn.q_proj: colwise" in log
    assert losses(out) == pytest.approx(losses(reference), rel=1e-4)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), rel=1e-4)
    assert max(grad_norms(reference)) > 1.0  # clipping at 1.0 acted on some steps
    assert [v for _, v in val_losses(out)] == pytest.approx([v for _, v in val_losses(reference)], rel=1e-4)
    assert len(val_losses(out)) == 2
    if not sequence_parallel:  # generation after training: every rank runs it, the head gathers the logits
        report = json.loads((out / "eval_generation.json").read_text())
        assert report == json.loads((reference / "eval_generation.json").read_text())
    assert_same_weights(out / "epoch_0_step_6" / "model", reference / "epoch_0_step_6" / "model")


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_a_tp2_checkpoint_resumes_in_one_process(one_process, tp2_run, tmp_path):
    config, reference = one_process
    checkpoint = tp2_run[0] / "epoch_0_step_3"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert (state["world_size"], state["dp_size"]) == (2, 1)
    one = tmp_path / "one"
    log = _run(config, tmp_path, one, "--restore_from.path", checkpoint)
    assert "written by 2 ranks, resuming on 1" in log
    assert [row["step"] for row in read_jsonl(one / "training.jsonl")] == [4, 5, 6]
    assert losses(one) == pytest.approx(losses(reference)[3:], rel=1e-4)
    assert_same_weights(one / "epoch_0_step_6" / "model", reference / "epoch_0_step_6" / "model")
    again = tmp_path / "again"  # the same layout: each rank's own data position and its slices of model/
    log = _run(config, tmp_path, again, *TP2, "--restore_from.path", checkpoint, "--eval_generation.enabled", "false")
    assert "resuming on" not in log
    assert losses(again) == pytest.approx(losses(tp2_run[0])[3:], rel=1e-6)


def test_layouts_the_model_cannot_take_are_refused_byvalidate_cli(tp_llama_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", tp_llama_config, tmp_path / "ckpt",
                          distributed={"strategy": "fsdp2", "tp_size": 3})
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "3", subprocess=True)
    assert code == 2 and "Traceback" not in out
    for what in ("attention heads (num_attention_heads = 4)", "key/value heads (num_key_value_heads = 2)",
                 "vocabulary size (vocab_size = 482)"):
        assert f"distributed.tp_size: 3 does not divide the model's {what}" in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "4")
    assert code == 2 and "the world size 4 is not divisible by 3" in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.tp_size", "2",
                          "--distributed.strategy", "ddp")
    assert code == 2 and "distributed.strategy: ddp: tensor parallelism (tp_size 2) composes with FSDP2" in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.tp_size", "1",
                          "--distributed.sequence_parallel", "true")
    assert code == 2 and "so it needs tensor parallelism (distributed.tp_size > 1)" in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.tp_size", "2",
                          "--distributed.sequence_parallel", "true", "--eval_generation.enabled", "true")
    assert code == 2 and "eval_generation.enabled: generation feeds one token at a time" in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.tp_size", "2",
                          "--distributed.sequence_parallel", "true", "--packed_sequence.packed_sequence_size", "63",
                          "--peft.dim", "4", "--peft.target_modules", "[q_proj]")
    assert code == 2
    assert "packed_sequence.packed_sequence_size: 63 does not divide by tp_size 2" in out
    assert "sequence_parallel" not in out.replace("packed_sequence", "")  # LoRA composes with it
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.tp_size", "2", "--peft.dim", "4",
                          "--peft.dropout", "0.1", "--peft.use_dora", "true")
    assert code == 2 and "Traceback" not in out
    assert "peft.dropout: 0.1 with tp_size 2: each tensor-parallel rank would draw its own dropout mask" in out
    assert "peft.use_dora: true with tp_size 2" in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.tp_size", "2", "--peft.dim", "4")
    assert code == 0, out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.tp_size", "2")
    assert code == 0, out
    result = run_cli_inprocess("validate", "kd", "llm", "-c", config, "--nproc-per-node", "2",
                               "--distributed.tp_size", "2",
                               "--teacher_model._target_", "automodel_llm.AutoModelForCausalLM.from_config",
                               "--teacher_model.config", str(tp_llama_config), cwd=tmp_path)
    assert result.returncode == 2 and "the distillation loss compares the student's whole logits" in result.stderr


def test_dry_run_prints_the_mesh_and_the_plan(tp_llama_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", tp_llama_config, tmp_path / "ckpt",
                          distributed={"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True})
    result = run_cli("finetune", "llm", "-c", config, "--nproc-per-node", "4", "--dry-run", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "device mesh: pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2 = 4 ranks" in out
    assert "rank 3: pp 0, dp_replicate 0, dp_shard 1, cp 0, tp 1 (dp 1)" in out
    assert "tensor parallel over tp 2, sequence parallel, vocabulary-parallel loss" in out
    assert "model.layers.*.mlp.down_proj: rowwise" in out and "lm_head: colwise_gather_output" in out



@pytest.fixture(scope="module")
def accumulating(tmp_path_factory, one_process) -> Path:
    """The one-process reference for dp = 2: two micro-batches per step (the samples of two data-parallel ranks)."""
    tmp = tmp_path_factory.mktemp("accumulating")
    _run(one_process[0], tmp, tmp / "ckpt", "--step_scheduler.grad_accumulation_steps", "2",
         "--eval_generation.enabled", "false")
    return tmp / "ckpt"


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_dp2_x_tp2_on_four_ranks_trains_like_one_process_and_resumes_with_fsdp2_on_two(one_process, accumulating,
                                                                                     tmp_path):
    """A 2-D mesh: FSDP2 shards each tensor-parallel shard over two data-parallel ranks; its step-3 checkpoint
    resumes under FSDP2 alone on two ranks (another world size and layout)."""
    config = one_process[0]
    out, dp2 = tmp_path / "dp2_tp2", tmp_path / "dp2"
    log = _run(config, tmp_path, out, "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
               "--distributed.tp_size", "2", "--eval_generation.enabled", "false")
    assert "FSDP2 over 2 ranks x tensor parallel over 2" in log
    assert losses(out) == pytest.approx(losses(accumulating), rel=1e-4)
    assert grad_norms(out) == pytest.approx(grad_norms(accumulating), rel=1e-4)
    assert [v for _, v in val_losses(out)] == pytest.approx([v for _, v in val_losses(accumulating)], rel=1e-4)
    assert_same_weights(out / "epoch_0_step_6" / "model", accumulating / "epoch_0_step_6" / "model")
    log = _run(config, tmp_path, dp2, "--nproc-per-node", "2", "--distributed.strategy", "fsdp2",
               "--restore_from.path", out / "epoch_0_step_3", "--eval_generation.enabled", "false")
    assert "written by 4 ranks, resuming on 2" in log
    assert losses(dp2) == pytest.approx(losses(accumulating)[3:], rel=1e-4)
    assert_same_weights(dp2 / "epoch_0_step_6" / "model", accumulating / "epoch_0_step_6" / "model")


def test_a_mixture_of_experts_model_tp2_trains_like_one_process_its_experts_whole(tmp_path):
    """transformers' plan for Qwen3-MoE (as Mixtral's) shards its experts ``moe_tp_experts`` / ``packed_colwise``:
    here the attention is split over the two ranks and the experts stay whole on each (both compute all of them on
    the same tokens), so the run has the losses, gradient norms and weights of one process."""
    from llm_testing import write_tiny_moe_config

    (tmp_path / "moe").mkdir()
    moe = write_tiny_moe_config(tmp_path / "moe")
    config = write_config(tmp_path / "cfg.yaml", moe, tmp_path / "one")
    _run(config, tmp_path, tmp_path / "one")
    log = _run(config, tmp_path, tmp_path / "tp", *TP2)
    assert "model.layers.*.mlp.experts: moe_tp_experts (experts whole on every tensor-parallel rank" in log
    assert "model.layers.*.self_attn.q_proj: colwise" in log
    assert losses(tmp_path / "tp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    assert grad_norms(tmp_path / "tp") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)
    assert_same_weights(tmp_path / "tp" / "epoch_0_step_6" / "model", tmp_path / "one" / "epoch_0_step_6" / "model")
    code, out = validate_cli(config, tmp_path, *TP2, "--distributed.sequence_parallel", "true")
    assert code == 2 and "their experts stay whole on every tensor-parallel rank" in out, out
