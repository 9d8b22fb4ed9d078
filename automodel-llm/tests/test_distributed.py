"""Two CPU ranks (gloo) through the CLI: DDP and FSDP2 match one process with doubled accumulation."""

from __future__ import annotations

import pytest
from llm_testing import DISTRIBUTED_OVERRIDES as COMMON
from llm_testing import losses as _losses
from llm_testing import val_losses

from automodel.testing import free_port, read_jsonl, run_cli


@pytest.mark.parametrize(("strategy", "checkpointing"), [("ddp", "true"), ("fsdp2", "false")])
def test_two_ranks_match_one_process_with_doubled_accumulation(strategy, checkpointing, single_process, tmp_path):
    """DDP also with activation checkpointing (it recomputes, the losses stay the same). Validation runs on both
    ranks, each its half of the samples (under FSDP2 a forward needs every rank), and rank 0 reports the loss over
    all of them: the one process's."""
    from transformers import AutoModelForCausalLM

    config, single = single_process
    out = tmp_path / strategy
    result = run_cli("finetune", "llm", "-c", config, *COMMON, "--distributed.strategy", strategy,
                     "--distributed.activation_checkpointing", checkpointing, "--nproc-per-node", "2",
                     "--master-port", free_port(), "--checkpoint.checkpoint_dir", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"sharding [{strategy}]" in result.stderr
    assert ("activation checkpointing on 1 transformer blocks" in result.stderr) == (checkpointing == "true")
    assert _losses(out) == pytest.approx(_losses(single / "ckpt"), abs=1e-5)
    validation, reference = val_losses(out), val_losses(single / "ckpt")
    assert [step for step, _ in validation] == [step for step, _ in reference] == [2, 4]
    assert [loss for _, loss in validation] == pytest.approx([loss for _, loss in reference], abs=1e-5)
    model = AutoModelForCausalLM.from_pretrained(out / "epoch_0_step_4" / "model")
    reference = AutoModelForCausalLM.from_pretrained(single / "ckpt" / "epoch_0_step_4" / "model")
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert (a - b).abs().max() < 1e-4, name


def test_fsdp2_checkpoint_resumes_on_two_ranks_exactly_and_on_one_rank(single_process, tmp_path):
    config, _ = single_process
    first, again, single = tmp_path / "first", tmp_path / "again", tmp_path / "one"
    base = ["finetune", "llm", "-c", config, *COMMON, "--distributed.strategy", "fsdp2"]
    assert run_cli(*base, "--nproc-per-node", "2", "--master-port", free_port(), "--checkpoint.checkpoint_dir",
                   first, cwd=tmp_path).returncode == 0
    restore = ["--restore_from.path", first / "epoch_0_step_2"]
    resumed = run_cli(*base, "--nproc-per-node", "2", "--master-port", free_port(), "--checkpoint.checkpoint_dir",
                      again, *restore, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(again) == _losses(first)[2:]  # bitwise: steps 3-4
    on_one = run_cli(*base, "--checkpoint.checkpoint_dir", single, *restore, cwd=tmp_path)
    assert on_one.returncode == 0, on_one.stderr[-3000:]
    assert [row["step"] for row in read_jsonl(single / "training.jsonl")] == [3, 4]
    assert "resuming on 1" in on_one.stderr
